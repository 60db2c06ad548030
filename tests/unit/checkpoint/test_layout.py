"""Pure checkpoint bookkeeping: atomic commit, keep-last-K, resume discovery, meta.json, RNG, compat."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dhp.checkpoint import (
    CheckpointMeta,
    ModuleRecord,
    begin_checkpoint,
    capture_rng_state,
    check_resume_compatible,
    commit_checkpoint,
    find_latest_checkpoint,
    list_checkpoints,
    read_meta,
    resolve_resume,
    restore_rng_state,
    stable_hash,
)
from dhp.config.schema import ModuleConfig
from dhp.errors import CheckpointError

pytestmark = pytest.mark.unit

PLAN = {"groups": [{"name": "vision", "mesh": {"sp": 2}}, {"name": "llm", "mesh": {"tp": 2}}]}


def _meta(step: int, **kw: object) -> CheckpointMeta:
    base: dict = dict(
        step=step,
        data_state={"epoch": 0, "index": step * 4},
        driver_rng=capture_rng_state(),
        plan=PLAN,
        config_hash="c",
        model_hash="m",
        modules={
            "vision": ModuleRecord(world_size=2, frozen=False, has_optimizer=True),
            "llm": ModuleRecord(world_size=2, frozen=False, has_optimizer=True),
        },
    )
    base.update(kw)
    return CheckpointMeta(**base)


def _save(ckpts: Path, step: int, keep_last: int = 2, **kw: object) -> Path:
    tmp = begin_checkpoint(ckpts, step=step)
    assert tmp.name == f"step_{step:06d}.tmp-{os.getpid()}"
    for name in ("vision", "llm"):
        (tmp / name).mkdir()
        (tmp / name / "shard").write_text(str(step))
    return commit_checkpoint(tmp, meta=_meta(step, **kw), keep_last=keep_last)


def test_commit_is_atomic_rename_and_meta_roundtrips(tmp_path: Path) -> None:
    final = _save(tmp_path, 100)
    assert final == tmp_path / "step_000100"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000100"]
    meta = read_meta(final)
    assert meta == _meta(100, driver_rng=meta.driver_rng, dhp_version=meta.dhp_version)
    assert meta.modules["llm"] == ModuleRecord(world_size=2, frozen=False, has_optimizer=True)
    assert meta.dhp_version  # filled in on write


def test_uncommitted_tmp_is_invisible_and_missing_group_refuses(tmp_path: Path) -> None:
    _save(tmp_path, 5)
    tmp = begin_checkpoint(tmp_path, step=10)
    (tmp / "vision").mkdir()
    with pytest.raises(CheckpointError, match=r"\['llm'\] wrote nothing"):
        commit_checkpoint(tmp, meta=_meta(10), keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5]
    assert not (tmp / "meta.json").exists()


def test_keep_last_k_and_dead_writer_tmp_pruned(tmp_path: Path) -> None:
    dead = tmp_path / "step_000003.tmp-999999999"  # no such pid
    dead.mkdir(parents=True)
    for step in (1, 2, 4, 6):
        _save(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "step_000006"]


def test_keep_last_zero_keeps_all_and_resave_same_step_replaces(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=0)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2, 3]
    _save(tmp_path, 3, keep_last=0, config_hash="new")
    assert read_meta(tmp_path / "step_000003").config_hash == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002", "step_000003"]


def test_resolve_resume_auto_picks_newest_complete_over_run_dirs(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    assert resolve_resume("auto", output_dir=runs, name="tiny") is None  # nothing yet: start fresh
    _save(runs / "tiny" / "20260101-000000" / "checkpoints", 8)
    _save(runs / "tiny" / "20260102-000000" / "checkpoints", 4)
    _save(runs / "other" / "20260103-000000" / "checkpoints", 50)
    begin_checkpoint(runs / "tiny" / "20260102-000000" / "checkpoints", step=12)  # incomplete
    best = resolve_resume("auto", output_dir=runs, name="tiny")
    assert best == runs / "tiny" / "20260101-000000" / "checkpoints" / "step_000008"
    assert find_latest_checkpoint(output_dir=runs, name="tiny") == best
    assert resolve_resume(None, output_dir=runs, name="tiny") is None
    run_dir = runs / "tiny" / "20260102-000000"
    assert resolve_resume(str(run_dir), output_dir=runs, name="x") == run_dir / "checkpoints" / "step_000004"
    assert resolve_resume(str(best), output_dir=runs, name="x") == best


def test_resolve_resume_bad_paths_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such path"):
        resolve_resume(str(tmp_path / "nope"), output_dir=tmp_path, name="t")
    tmp = begin_checkpoint(tmp_path, step=3)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve_resume(str(tmp), output_dir=tmp_path, name="t")
    with pytest.raises(CheckpointError, match=r"meta\.json is missing"):
        read_meta(tmp)


def test_corrupt_meta_is_typed_error(tmp_path: Path) -> None:
    final = _save(tmp_path, 1)
    (final / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        read_meta(final)
    raw = json.loads(json.dumps({"format_version": 99}))
    (final / "meta.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="format_version 99"):
        read_meta(final)


def test_rng_roundtrip_through_json() -> None:
    state = json.loads(json.dumps(capture_rng_state()))
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    restore_rng_state(state)
    again = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[:2] == again[:2]
    assert torch.equal(first[2], again[2])


def test_stable_hash_is_order_independent_and_sensitive() -> None:
    assert stable_hash({"a": 1, "b": [1, 2]}) == stable_hash({"b": [1, 2], "a": 1})
    assert stable_hash({"a": 1}) != stable_hash({"a": 2})
    assert stable_hash(ModuleConfig()) == stable_hash(ModuleConfig())


def _modules(vision_freeze: bool = False) -> dict[str, ModuleConfig]:
    return {"vision": ModuleConfig(freeze=vision_freeze), "llm": ModuleConfig()}


def test_compat_reshard_allowed_with_notes() -> None:
    new_plan = {"groups": [{"name": "vision", "mesh": {"sp": 2}}, {"name": "llm", "mesh": {"dp": 1}}]}
    notes = check_resume_compatible(_meta(5), plan=new_plan, modules=_modules(), model_hash="m")
    assert notes == ["llm: resharding mesh {'tp': 2} -> {'dp': 1} (RNG not restored exactly)"]
    assert check_resume_compatible(_meta(5), plan=PLAN, modules=_modules(), model_hash="m") == []


def test_compat_refusals_name_every_difference() -> None:
    frozen = _meta(5, modules={"vision": ModuleRecord(1, True, False), "llm": ModuleRecord(2, False, True)})
    with pytest.raises(CheckpointError) as e:
        check_resume_compatible(frozen, plan=PLAN, modules=_modules(), model_hash="other")
    msg = str(e.value)
    assert "model architecture differs" in msg
    assert "modules.vision: frozen when saved" in msg
    check_resume_compatible(frozen, plan=PLAN, modules=_modules(vision_freeze=True), model_hash="m")
    with pytest.raises(CheckpointError, match="module groups differ"):
        check_resume_compatible(_meta(5), plan=PLAN, modules={"llm": ModuleConfig()}, model_hash="m")


def test_model_arch_hash_ignores_dtype_and_path_but_not_shapes() -> None:
    from dhp.checkpoint import model_arch_hash
    from dhp.validation import load_config

    base = load_config("tiny_vlm", [])
    assert model_arch_hash(base.model) == model_arch_hash(
        load_config("tiny_vlm", ["model.dtype=bfloat16"]).model
    )
    assert model_arch_hash(base.model) != model_arch_hash(
        load_config("tiny_vlm", ["model.llm.num_layers=3"]).model
    )
    from omegaconf import OmegaConf

    assert model_arch_hash(OmegaConf.to_object(base).model) == model_arch_hash(base.model)


def test_module_records_from_config() -> None:
    from dhp.checkpoint import module_records

    recs = module_records(_modules(vision_freeze=True), world_sizes={"vision": 2, "llm": 4})
    assert recs == {"vision": ModuleRecord(2, True, False), "llm": ModuleRecord(4, False, True)}


def test_own_temps_are_removed_after_the_teardown_and_no_one_elses(tmp_path) -> None:
    """A save cut by a second signal: once the ranks are gone the driver removes its own temp dirs
    (``step_X.tmp-<its pid>`` and ``-old``), never another live writer's nor a committed step."""
    import os

    from dhp.checkpoint import remove_own_temps

    ck = tmp_path / "checkpoints"
    own = [ck / f"step_000011.tmp-{os.getpid()}", ck / f"step_000009.tmp-{os.getpid()}-old"]
    other = ck / "step_000011.tmp-1"  # pid 1: alive, someone else's
    done = ck / "step_000010"
    for d in (*own, other, done):
        (d / "llm").mkdir(parents=True)
    assert sorted(remove_own_temps(ck)) == sorted(own)
    assert sorted(p.name for p in ck.iterdir()) == ["step_000010", "step_000011.tmp-1"]
    assert remove_own_temps(tmp_path / "missing") == []
