"""`dhp plan` and `dhp recipes` through the real CLI (a subprocess, as a user runs them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def dhp(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dhp.cli", *args], capture_output=True, text=True, timeout=timeout, env=None
    )


@pytest.mark.slow
def test_dry_run_headline_tables() -> None:
    out = dhp("plan", "conf=qwen_vl_32b", "--dry-run")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    needles = (
        "vision",
        "llm",
        "sp=8",
        "tp=8",
        "0-7",
        "STRICT_PACK",
        "optimizer",
        "activations",
        "fits",
        "7: sp7",
        "workload (synthetic)",
        "micro-batches per step",
        "per step:",
    )
    for needle in needles:
        assert needle in text, needle


def test_json_parses_with_required_keys() -> None:
    out = dhp("plan", "conf=qwen_vl_32b", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [(g["name"], g["world_size"], len(g["ranks"])) for g in doc["groups"]] == [
        ("vision", 8, 8),
        ("llm", 8, 8),
    ]
    assert doc["placement"] == "collocated" and doc["fits"] is True
    assert doc["device_memory_bytes"] == int(79.6 * (1 << 30))
    gpus = [[r["gpu"] for r in g["ranks"]] for g in doc["groups"]]
    assert gpus[0] == gpus[1] == list(range(8))
    mem = doc["groups"][1]["ranks"][3]["memory"]
    assert set(mem) >= {"params", "grads", "optimizer", "activations", "total"}
    w = doc["workload"]  # what the numbers are for
    assert set(w) == {"source", "batch", "per_sample", "modules", "tokens_per_step"}
    assert set(w["batch"]) == {"micro_batch_size", "global_batch_size", "micro_batches_per_step"}
    assert set(w["per_sample"]) >= {
        "images",
        "videos",
        "video_frames",
        "audio",
        "llm_tokens",
        "vision_patches",
    }
    assert set(w["modules"]["vision"]) >= {"seq_len", "patches_per_micro_batch", "patches_per_rank"}
    assert set(w["modules"]["llm"]) >= {"seq_len", "rows_per_micro_batch", "tokens_per_row"}
    assert set(w["tokens_per_step"]) == {"text", "vision", "llm_padded"}


@pytest.mark.slow
def test_overrides_reach_the_plan() -> None:
    out = dhp(
        "plan",
        "conf=qwen_vl_32b",
        "modules.vision.parallel.sp=4",
        "modules.vision.parallel.dp=2",
        "modules.vision.parallel.zero=1",
        "train.micro_batch_size=2",
        "modules.vision.seq_len=32768",
        "--dry-run",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["groups"][0]["mesh"] == {"dp": 2, "sp": 4}


def test_bad_config_is_one_screen_without_traceback() -> None:
    out = dhp(
        "plan", "conf=qwen_vl_32b", "modules.vision.parallel.sp=3", "modules.llm.parallel.tp=16", "--dry-run"
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr + out.stdout
    assert "ConfigError" in out.stderr
    assert "modules.vision.parallel.sp" in out.stderr and "modules.llm.parallel.tp" in out.stderr
    assert len(out.stderr.splitlines()) < 40


#: a config that does not compose (an unknown key, an unknown group whose value the screen names; an
#: unknown recipe reaches the same ConfigError, exit code and screen, its key path ``conf`` is
#: test_config_validation.py's test_hydra_errors_become_config_errors[no_such_recipe-...]), and the two
#: argument errors parse_hydra_args raises
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["conf=qwen_vl_32b", "modules.vision.parallel.spp=2"], "modules.vision.parallel.spp"),
        (["conf=qwen_vl_32b", "model=qwen_vl_1000b"], "qwen_vl_1000b"),
        (["modules.vision.parallel.sp=2"], "conf= is required"),
        (["conf=qwen_vl_32b", "stray"], "stray"),
    ],
)
def test_user_errors_exit_2(args: list[str], needle: str) -> None:
    out = dhp("plan", *args, "--dry-run")
    assert out.returncode == 2, out.stdout
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_recipes_lists_every_recipe() -> None:
    out = dhp("recipes")
    assert out.returncode == 0
    for name in (
        "qwen_vl_32b",
        "qwen_vl_32b_tp",
        "qwen_vl_32b_zero3",
        "qwen_vl_7b",
        "qwen_vl_72b",
        "tiny_vlm",
    ):
        assert name in out.stdout


@pytest.mark.slow
def test_smoke_flag_shrinks_to_cpu() -> None:
    out = dhp("plan", "conf=qwen_vl_72b", "smoke=true", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["device"] == "cpu" and doc["fits"]
    assert [g["mesh"] for g in doc["groups"]] == [{"dp": 2, "sp": 2}, {"fsdp": 2, "tp": 2}]


@pytest.mark.slow
def test_reserve_on_local_ray_then_release() -> None:
    out = dhp("plan", "conf=tiny_vlm", timeout=180)
    assert out.returncode == 0, out.stderr
    assert "reserved on the Ray cluster and released" in out.stdout


@pytest.mark.slow
def test_unplaceable_plan_names_missing_resources() -> None:
    # the tiny model planned for 8 GPUs: this CPU box's local Ray has no GPU at all
    out = dhp("plan", "conf=tiny_vlm", "cluster=h100_8x", timeout=180)
    assert out.returncode == 2, out.stdout
    assert "PlanError" in out.stderr and "GPU" in out.stderr and "Traceback" not in out.stderr


def test_many_errors_stay_on_one_screen() -> None:
    from dhp.cli import MAX_ISSUES_SHOWN, error_text
    from dhp.errors import ConfigError, ConfigIssue

    err = ConfigError([ConfigIssue(path=f"k{i}", value=i, rule="bad", fix="fix") for i in range(40)])
    text = error_text(err)
    assert len(text.splitlines()) == MAX_ISSUES_SHOWN + 2
    assert "40 config error(s)" in text and "25 more" in text


def test_smoke_typo_is_an_error_not_false() -> None:
    """``smoke=ture`` must not silently run the full-size recipe."""
    from dhp.cli import parse_hydra_args
    from dhp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"smoke = 'ture': must be true or false"):
        parse_hydra_args(["conf=tiny_vlm", "smoke=ture"])
    assert parse_hydra_args(["conf=tiny_vlm", "smoke=false"]) == ("tiny_vlm", [], False)
