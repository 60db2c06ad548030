"""``checkpoint.async_save: true`` end to end (real Ray, gloo, the tiny Qwen2.5-VL, one rank per
module; one Ray for the module): every checkpoint step is committed with a manifest that verifies
and a metrics ``checkpoint`` event naming the staging and write seconds; a resume from the middle
checkpoint gives bit-identical losses (CPU fp32, same plan); a save killed in flight (what a crash
leaves: a temp dir with partial shards) is never a resume candidate and is removed at the next
start."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from plans import ALL_ONE

from dhp.checkpoint import remove_stale_temps, resolve_resume, verify_checkpoint
from dhp.runtime.loop.train import train
from dhp.validation import load_config

pytestmark = pytest.mark.integration

STEPS = 3


def _cfg(out, *overrides):
    return load_config(
        "tiny_vlm",
        [
            *ALL_ONE,
            "name=asy",
            f"train.output_dir={out}",
            f"train.steps={STEPS}",
            "train.checkpoint_every=1",
            "train.keep_last=5",
            "checkpoint.async_save=true",
            *overrides,
        ],
    )


@pytest.mark.slow
def test_async_checkpoints_verify_and_resume_exactly(ray_local, tmp_path) -> None:
    a = train(_cfg(tmp_path))
    ckpts = sorted((a.run_dir / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == [f"step_{s:06d}" for s in range(1, STEPS + 1)]
    assert all(verify_checkpoint(p) == [] for p in ckpts)
    assert a.last_checkpoint == ckpts[-1]
    rows = [json.loads(x) for x in (a.run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in rows if r.get("event") == "checkpoint"]
    assert [e["step"] for e in events] == list(range(1, STEPS + 1))
    assert all(e["async"] and e["staging_s"] >= 0 and e["write_s"] >= 0 for e in events)

    # a save killed in flight: its temp dir holds partial shards and no manifest or meta.json
    crashed = a.run_dir / "checkpoints" / f"step_{STEPS + 1:06d}.tmp-999999999"
    shutil.copytree(ckpts[-1], crashed)
    (crashed / "meta.json").unlink()
    shard = next(crashed.rglob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)
    assert resolve_resume("auto", output_dir=tmp_path, name="asy") == ckpts[-1]
    b = train(_cfg(tmp_path, f"train.resume={ckpts[1]}"))
    assert not crashed.exists()  # removed at start (its writer's pid is gone)
    assert {s: b.losses[s] for s in range(3, STEPS + 1)} == {s: a.losses[s] for s in range(3, STEPS + 1)}
    assert remove_stale_temps(tmp_path, name="asy") == []  # nothing left behind by run b
