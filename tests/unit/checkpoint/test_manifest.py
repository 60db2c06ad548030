"""Checkpoint integrity: the manifest's checksums catch truncation, zeroed blocks, missing and
unlisted files; resume=auto falls back past a bad checkpoint and names it; an explicit bad path
is refused; stale temp dirs of dead writers are removed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dhp.checkpoint import (
    CheckpointMeta,
    ModuleRecord,
    begin_checkpoint,
    capture_rng_state,
    commit_checkpoint,
    remove_stale_temps,
    resolve_resume,
    verify_checkpoint,
)
from dhp.errors import CheckpointError

pytestmark = pytest.mark.unit


def _save(ckpts: Path, step: int) -> Path:
    tmp = begin_checkpoint(ckpts, step=step)
    for name in ("vision", "llm"):
        (tmp / name).mkdir()
        (tmp / name / "__0_0.distcp").write_bytes(os.urandom(3 * 4096 + 17))
        (tmp / name / ".metadata").write_bytes(b"m" * 100)
    meta = CheckpointMeta(
        step=step,
        data_state={},
        driver_rng=capture_rng_state(),
        plan={},
        config_hash="c",
        model_hash="m",
        modules={n: ModuleRecord(world_size=1, frozen=False, has_optimizer=True) for n in ("vision", "llm")},
    )
    return commit_checkpoint(tmp, meta=meta, keep_last=5)


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Path, Path]:
    ckpts = tmp_path / "runs" / "t" / "20260101-000000" / "checkpoints"
    return tmp_path / "runs", _save(ckpts, 2), _save(ckpts, 4)


def _zero_4k(f: Path) -> None:
    with open(f, "r+b") as fh:
        fh.seek(4096)
        fh.write(b"\0" * 4096)


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda c: os.truncate(c / "llm" / "__0_0.distcp", 4096), "truncated"),
        (lambda c: _zero_4k(c / "llm" / "__0_0.distcp"), "checksum mismatch"),
        (lambda c: (c / "vision" / ".metadata").unlink(), "missing"),
        (lambda c: (c / "meta.json").unlink(), "meta.json is missing"),
        (lambda c: (c / "meta.json").write_bytes(bytes(range(256))), "not valid JSON"),
        (lambda c: (c / "manifest.json").unlink(), "manifest.json is missing"),
        (lambda c: (c / "llm" / "__1_0.distcp").write_bytes(b"x"), "not in the manifest"),
    ],
)
def test_damage_is_detected_and_auto_resume_falls_back_naming_it(run, damage, says) -> None:
    runs, older, newest = run
    assert verify_checkpoint(newest) == [] and verify_checkpoint(older) == []
    damage(newest)
    problems = verify_checkpoint(newest)
    assert problems and says in " ".join(problems), problems
    skipped: list[tuple[Path, list[str]]] = []
    got = resolve_resume("auto", output_dir=runs, name="t", on_skip=lambda p, why: skipped.append((p, why)))
    assert got == older  # the previous checkpoint, not a silent start from scratch
    assert skipped == [(newest, problems)]
    with pytest.raises(CheckpointError, match=r"fails verification|not a complete checkpoint"):
        resolve_resume(str(newest), output_dir=runs, name="t")


def test_manifest_lists_every_file_with_size_and_digest(run) -> None:
    _, _, newest = run
    m = json.loads((newest / "manifest.json").read_text())
    assert m["hash"] == "blake2b-128"
    assert set(m["files"]) == {f"{n}/{f}" for n in ("vision", "llm") for f in ("__0_0.distcp", ".metadata")}
    assert m["files"]["llm/__0_0.distcp"]["size"] == 3 * 4096 + 17


def test_stale_temp_dirs_of_dead_writers_are_removed(run) -> None:
    runs, _, newest = run
    dead = newest.parent / "step_000006.tmp-999999"  # no such pid
    old = newest.parent / "step_000004.tmp-999998-old"
    live = newest.parent / f"step_000008.tmp-{os.getppid()}"  # a live writer: left alone
    for d in (dead, old, live):
        d.mkdir()
    removed = remove_stale_temps(runs, name="t")
    assert sorted(removed) == sorted([dead, old])
    assert live.exists() and not dead.exists() and not old.exists()
