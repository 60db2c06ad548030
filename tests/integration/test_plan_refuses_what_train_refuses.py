"""`dhp plan` (with and without --dry-run) makes every check `dhp train` makes before step 1, and both
report every problem at once, in one ConfigError, before any process starts: a missing model.path
(and a model directory without weights or tokenizer), bad rows among the rows start-up samples (each
named by file:line and reason), and a long video breaking several per-sample limits (each limit
with the longest row and the values that make it fit). No Ray: each command is refused before one
would start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import skimage
from cli_here import dhp_here, explain
from PIL import Image

from dhp.errors import ConfigError
from dhp.models import make_tiny_checkpoint

pytestmark = pytest.mark.integration
PHOTOS = Path(skimage.__file__).parent / "data"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Photos, a long video (64 frames of 224x224 px in a folder, 32 s at 2 fps), the data files and
    the cache the commands share (the tiny checkpoints are written once)."""
    root = tmp_path_factory.mktemp("own_data")
    for name in ("astronaut.png", "chelsea.png", "coffee.png"):
        shutil.copy(PHOTOS / name, root / name)
    clip = root / "long_clip"
    clip.mkdir()
    for i in range(64):  # a square crossing the frame
        frame = Image.new("RGB", (224, 224), (20, 120, 20))
        frame.paste((200, 30, 30), (3 * i, 80, 3 * i + 40, 120))
        frame.save(clip / f"{i:03d}.png")

    def chat(q: str, a: str, **media) -> dict:
        return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}], **media}

    good = [
        chat("<image>What is in the photo?", "An astronaut.", images=[str(root / "astronaut.png")]),
        chat("<image>Describe it.", "A cat on a sofa.", images=[str(root / "chelsea.png")]),
        chat("What is two plus two?", "Four."),
    ]
    rows = good * 4  # 12 rows
    rows[3] = chat("<image>What is this?", "A photo.", images=[str(root / "no_such_photo.png")])
    rows[10] = chat("<image><image>Two?", "One.", images=[str(root / "coffee.png")])
    lines = [json.dumps(r) for r in rows]
    lines[8] = '{"messages": [{"role": "user", "content": "cut off'  # line 9: not JSON
    (root / "bad_rows.jsonl").write_text("\n".join(lines) + "\n")
    (root / "photos.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    video = [*good[:2], chat("<video>What moves?", "A red square, left to right.", videos=[str(clip)])]
    (root / "long_video.jsonl").write_text("".join(json.dumps(r) + "\n" for r in video))
    broken = make_tiny_checkpoint(root / "no_weights")  # a model directory without weights or tokenizer
    for f in broken.iterdir():
        if f.name not in ("config.json", "preprocessor_config.json"):
            f.unlink()
    return {"root": root, "cache": root / "cache", "broken": broken}


def dhp(files, *args: str) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess (its exit status and its screen)."""
    env = dict(os.environ, DHP_CACHE_DIR=str(files["cache"]))
    return subprocess.run(
        [sys.executable, "-m", "dhp.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )


def flat(text: str) -> str:
    """The output without the error panel's borders and without any whitespace (it wraps anywhere)."""
    for ch in "│╭╮╰╯─":
        text = text.replace(ch, "")
    return "".join(text.split())


def refused_alike(files, monkeypatch, args: list[str], expected: list[str], *, plan_modes=("--dry-run",)):
    """`dhp plan` (each of ``plan_modes``) and `dhp train` refuse ``args`` with one ConfigError whose
    issues are exactly ``expected`` (each a prefix of one issue, in order); train starts nothing (no
    run directory). The commands run in this process (typer's runner: the CLI's own parsing and
    calls; the entry point's exit status is checked once, in a subprocess, below). Returns the issues."""
    monkeypatch.setenv("DHP_CACHE_DIR", str(files["cache"]))
    out = files["root"] / "runs"
    runs = [["plan", *args, mode] if mode else ["plan", *args] for mode in plan_modes]
    runs.append(["train", *args, f"train.output_dir={out}", "train.steps=2"])
    got = []
    for cmd in runs:
        res = dhp_here(*cmd)
        assert isinstance(res.exception, ConfigError), (cmd, explain(res))
        got.append([str(i) for i in res.exception.issues])
    assert not out.exists()  # refused before a run directory, Ray or a rank existed
    assert all(issues == got[0] for issues in got), got  # plan and train: the same problems
    assert len(got[0]) == len(expected) and all(
        i.startswith(e) for i, e in zip(got[0], expected, strict=True)
    ), (expected, got[0])
    return got[0]


def test_a_missing_model_path_and_a_broken_model_dir(files, monkeypatch):
    data = f"data.path={files['root'] / 'photos.jsonl'}"
    # a model with no tiny checkpoint to stand in, and data.max_pixels over the encoder's bound: both at once
    refused_alike(
        files,
        monkeypatch,
        ["conf=tiny_qwen3_5", "model.tiny=false", data, "data.max_pixels=200704"],
        [
            "model.path = None: real data (data.kind=llava) needs the model's tokenizer and image processor",
            "modules.vision.seq_len = 256: one image at data.max_pixels=200704 has about 784 patches",
        ],
        plan_modes=("--dry-run", ""),
    )
    broken = str(files["broken"])
    refused_alike(
        files,
        monkeypatch,
        ["conf=tiny_vlm", f"model.path={broken}", data],
        [
            f"model.path = '{broken}': has no weights (model.safetensors or model.safetensors.index.json)",
            f"model.path = '{broken}': has no tokenizer (tokenizer_config.json)",
        ],
    )


def test_bad_rows_among_the_sampled_ones_are_named_by_line_and_reason(files, monkeypatch):
    path = files["root"] / "bad_rows.jsonl"
    issues = refused_alike(
        files,
        monkeypatch,
        ["conf=tiny_vlm", f"data.path={path}"],
        [
            f"data.datasets.0 = '{path}:4': a sampled row is a bad sample (missing_file)",
            f"data.datasets.0 = '{path}:9': a sampled row is a bad sample (malformed_record)",
            f"data.datasets.0 = '{path}:11': a sampled row is a bad sample (placeholder_mismatch)",
        ],
        plan_modes=("--dry-run", ""),
    )
    assert all(i.endswith("or set data.on_bad_sample=skip to skip and count such rows") for i in issues)
    # under skip the same rows are said (stderr) and the plan goes on
    res = dhp_here("plan", "conf=tiny_vlm", f"data.path={path}", "data.on_bad_sample=skip", "--dry-run")
    assert res.exit_code == 0, explain(res)
    said = flat(res.output)
    assert flat("data.on_bad_sample=skip: among the sampled rows, the run will skip:") in said
    assert all(flat(f"{path}:{n}") in said for n in (4, 9, 11))


@pytest.mark.slow
def test_a_long_video_breaks_every_limit_in_one_run(files, monkeypatch):
    path = files["root"] / "long_video.jsonl"
    args = [
        "conf=tiny_vlm",
        f"data.path={path}",
        "data.max_pixels=200704",
        "data.video_max_frames=32",
        "data.video_max_pixels=50176",
    ]
    # 32 frames of 224x224 px: 16 temporal patches x 256 patches = 4096 patches, 1024 video tokens; the
    # photos at 200704 px break the encoder's bound too (all 3 rows), the video is the longest
    row = f"{path}:3"
    expected = [
        "modules.vision.seq_len = 256: one image at data.max_pixels=200704 has about 1024 patches",
        f"modules.vision.seq_len = 256: 3 of the 3 sampled rows have more encoder patches than it; "
        f"the longest, {row}, has 4096 (video 4096 from 32 frames). Fix: raise modules.vision.seq_len to "
        "at least 4096 (8192 for a micro-batch of 2 such rows), or lower data.video_max_frames to 2 "
        "(now 32), or lower data.video_max_pixels (now 50176)",
        f"modules.llm.seq_len = 256: 2 of the 3 sampled rows have more LLM tokens than it; the longest, "
        f"{row}, has 1101 (0 image, 1024 video, 77 text). Fix: raise modules.llm.seq_len to at least 1101",
    ]
    refused_alike(files, monkeypatch, args, expected)
    # the entry point: exit status 2, the one error on stderr, no traceback
    res = dhp(files, "plan", *args, "--dry-run")
    assert res.returncode == 2 and res.stdout == "", res.stderr[-3000:]
    text = flat(res.stderr)
    assert text.count("ConfigError") == 1 and "3configerror(s)" in text and "Traceback" not in res.stderr
    assert all(flat(e) in text for e in expected), res.stderr[-4000:]


def test_an_sft_recipe_is_refused_without_its_files_and_planned_with_worst_case(files, monkeypatch):
    """An SFT recipe takes the user's model.path and data.path: plan and train both refuse it without
    them, naming both; `dhp plan --worst-case` plans it (every micro-batch at seq_len) and says what
    train will still need, and refuses every other problem as before."""
    need = [
        "model.path = None: real data (data.kind=llava) needs the model's tokenizer and image processor",
        "data.datasets = []: data.kind=llava needs at least one dataset",
    ]
    refused_alike(files, monkeypatch, ["conf=sft_qwen_vl_7b", "train.epochs=0", "train.steps=2"], need)
    res = dhp_here("plan", "conf=sft_qwen_vl_7b", "--dry-run", "--worst-case", "--json")
    assert res.exit_code == 0, explain(res)
    said = flat(res.output)
    assert flat("--worst-case: every micro-batch filled to its seq_len; no data row is read.") in said
    assert flat("dhp train needs what this plan went without: model.path: set model.path=DIR") in said
    assert flat("data.datasets: give your data with data.path=FILE") in said
    plan = json.loads(res.stdout[res.stdout.index("{") :])
    assert plan["fits"], plan["memory"] if "memory" in plan else plan.keys()
    # another problem is still a problem, and the inputs are not among them
    res = dhp_here("plan", "conf=sft_qwen_vl_7b", "modules.llm.parallel.fsdp=3", "--dry-run", "--worst-case")
    assert isinstance(res.exception, ConfigError), explain(res)
    issues = [str(i) for i in res.exception.issues]
    assert issues and not any(i.startswith(("model.path", "data.datasets")) for i in issues), issues
