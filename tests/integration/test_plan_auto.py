"""`dhp plan --auto --save` writes a recipe that `dhp train` runs unchanged (real CLI, real Ray).

The two plans run the installed entry point in processes of their own; the train is the CLI's own
command in this process, on the shared test Ray (``cli_here``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from cli_here import dhp_here, explain

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def dhp(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dhp.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_auto_saves_a_recipe_that_trains(tmp_path, ray_local) -> None:
    recipe = tmp_path / "auto.yaml"
    # 2 CPU "GPUs" keep the run small; these fixed settings must survive into the saved recipe
    fixed = [
        "cluster.gpus_per_node=2",
        "train.steps=1",
        "train.warmup_steps=0",
        f"train.output_dir={tmp_path / 'runs'}",
        "name=auto",
    ]
    out = dhp("plan", "conf=tiny_vlm", *fixed, "--auto", "--dry-run", "--save", str(recipe))
    assert out.returncode == 0, out.stderr
    assert "winner:" in out.stdout and " wins: " in out.stdout
    saved = yaml.safe_load(recipe.read_text())
    assert saved["cluster"]["gpus_per_node"] == 2 and saved["train"]["steps"] == 1
    assert saved["description"].startswith("dhp plan --auto: ")
    again = dhp("plan", "conf=tiny_vlm", *fixed, "--auto", "--dry-run", "--json")
    plan = json.loads(again.stdout)
    assert plan["fits"] and plan["estimate"]["step_time_s"] > 0
    mesh = {g["name"]: g["mesh"] for g in plan["groups"]}
    for name in ("vision", "llm"):  # deterministic: the same winner both times
        par = {k: v for k, v in saved["modules"][name]["parallel"].items() if k in mesh[name] and v > 1}
        assert par == {k: v for k, v in mesh[name].items() if v > 1}
    run = dhp_here("train", f"conf={recipe}")
    assert run.exit_code == 0, explain(run)
    (run_dir,) = (tmp_path / "runs" / "auto").iterdir()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
