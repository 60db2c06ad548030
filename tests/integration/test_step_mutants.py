"""The driver step through the real runtime (Ray actor groups, gloo, hand-off) against the
single-process reference, plus direct observations of what equal numbers cannot show.

One shared Trainer (collocated on 2 slots: vision FSDP=2, LLM dp=2 with ZeRO-1, both modules under
full AC, 2 micro-batches per replica, clipping active) serves every test here, so the module costs
one Ray start and one build; the fixture runs ``dhp verify``'s comparison first, from fresh
optimizer states. Each test is aimed at a class of bug that once survived the fast suite:

- the loss normalised by a replica's or micro-batch's own label-token count instead of the global
  ``T`` (wrong gradient scale), a row swap in the image hand-off (wrong LLM input), clipping by each
  group's own norm instead of the global one (wrong update): ``test_step_matches_reference``
  compares (``dhp.runtime.verify.compare.compare_steps``) the loss, the global grad norm, every gradient and
  every parameter after each step;
- clipping is also observed directly: the gradient the optimizers step with has the global norm
  ``grad_clip`` summed over both groups (per-group clipping gives ``grad_clip * sqrt(2)``);
- activation checkpointing replaced by a no-op: forward hooks on the checkpointed layers count two
  calls per micro-batch (forward + recompute in backward), one without AC;
- the worker RNG not restored at resume: each rank's torch RNG state after ``load_modules`` is the
  one saved, byte for byte, though the stream was advanced in between.

Tolerances (fp32 on CPU): the plan and the reference differ only in reduction order (DP sums,
micro-batch accumulation, the chunked CE): loss 1e-5 relative, grads and parameters 1e-5 absolute
(observed ~1e-7); each bug above moves them by orders of magnitude more.
"""

from __future__ import annotations

import hashlib
import math
import sys

import pytest
import ray
import ray.cloudpickle
import torch

from dhp.data import build_run_loader
from dhp.plan import compile_plan
from dhp.plan.compile import module_layouts
from dhp.runtime import Trainer
from dhp.runtime.verify.compare import VerifyReport, compare_steps
from dhp.validation import load_config

pytestmark = pytest.mark.integration

GRAD_CLIP = 0.05  # far below the tiny model's grad norm (~1-5), so every step clips
OVERRIDES = [
    "placement=collocated",
    "modules.vision.gpus=2",
    "modules.vision.parallel.sp=1",
    "modules.vision.parallel.fsdp=2",
    "modules.vision.activation_checkpointing=full",
    "modules.llm.gpus=2",
    "modules.llm.parallel.tp=1",
    "modules.llm.parallel.dp=2",
    "modules.llm.parallel.zero=1",
    "modules.llm.parallel.sequence_parallel=false",
    "modules.llm.activation_checkpointing=full",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",  # 2 micro-batches per replica: accumulation and DP both in play
    f"train.grad_clip={GRAD_CLIP}",
]


@pytest.fixture(scope="module")
def rig(ray_local):
    # the probes below run inside the actors: ship this module's functions by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = load_config("tiny_vlm", OVERRIDES)
    trainer = Trainer(cfg, compile_plan(cfg))
    try:
        loader = build_run_loader(cfg, module_layouts(cfg))
        report = VerifyReport(loss_rtol=1e-5, grad_atol=1e-5, param_atol=1e-5)
        lrs = iter([1e-3, 2e-3])
        compare_steps(trainer, cfg, loader=loader, lr=lambda: next(lrs), steps=2, report=report)
        yield cfg, trainer, loader, report
    finally:
        trainer.close()


def _on_each(trainer: Trainer, fn, *args) -> dict[str, list]:
    """``fn(worker, *args)`` on every rank of every group (inside the actor), collected per module."""
    return {
        name: ray.get([a.__ray_call__.remote(fn, *args) for a in g.actors], timeout=120)
        for name, g in trainer.groups.items()
    }


def test_step_matches_reference(rig) -> None:
    cfg, _, _, report = rig
    first = next(
        build_run_loader(cfg, module_layouts(cfg))
    )  # the batch of step 1, as the fixture's loader drew it
    counts = [sum(int((b.labels != -100).sum()) for b in mb) for mb in first.micro_batches]
    assert len(counts) == 2 and counts[0] != first.num_label_tokens  # micro-batch T != global T
    assert len(report.steps) == 2
    for s in report.steps:
        assert set(s.grad_max_abs_diff) == set(s.param_max_abs_diff) == {"vision", "llm"}
        assert s.ref_grad_norm > 4 * GRAD_CLIP  # clipping is active
    assert report.passed, report.steps


def _record_update_norm(worker) -> None:
    """Record, at each optimizer step, the squared norm of the gradient the optimizer steps with."""
    from dhp import parallel as par

    worker._seen_norm_sq = []
    worker.optimizer.register_step_pre_hook(
        lambda opt, a, k: worker._seen_norm_sq.append(float(par.grad_norm_sq(worker.module, worker.mesh)))
    )


def test_update_is_clipped_by_the_global_norm(rig) -> None:
    _, trainer, loader, _ = rig
    _on_each(trainer, _record_update_norm)
    res = trainer.step(next(loader), lr=1e-3)
    seen = _on_each(trainer, lambda w: w._seen_norm_sq)
    assert all(len(r) == 1 for ranks in seen.values() for r in ranks), seen  # one update per rank
    per_group = {m: ranks[0][0] for m, ranks in seen.items()}
    for m, ranks in seen.items():  # the full module's norm: identical on every rank of a group
        assert all(r[0] == pytest.approx(per_group[m], rel=1e-9) for r in ranks), seen
    assert res.grad_norm > 4 * GRAD_CLIP
    # both groups scaled by the ONE coefficient grad_clip / global norm: together they have norm grad_clip
    assert math.sqrt(sum(per_group.values())) == pytest.approx(GRAD_CLIP, rel=1e-4), per_group


def _count_layer_forwards(worker) -> None:
    """Forward hooks on the sub-modules of every layer AC may checkpoint (transformers'
    GradientCheckpointingLayer: vision blocks, decoder layers), counting their calls per layer.

    The layer's own hooks cannot see a recompute (transformers re-runs the layer's ``forward``, not
    its ``__call__``); its sub-modules' hooks can."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    worker._ac_probe = []
    for layer in (m for m in worker.module.modules() if isinstance(m, GradientCheckpointingLayer)):
        counter = [0, 0]  # [calls, sub-modules]
        for child in layer.children():
            counter[1] += 1
            child.register_forward_hook(lambda *_, c=counter: c.__setitem__(0, c[0] + 1))
        worker._ac_probe.append(counter)


def test_activation_checkpointing_recomputes_every_layer(rig) -> None:
    _, trainer, loader, _ = rig
    _on_each(trainer, _count_layer_forwards)
    trainer.step(next(loader), lr=1e-3)
    got = _on_each(trainer, lambda w: [tuple(c) for c in w._ac_probe])
    micro = 2  # micro-batches per step: each FSDP rank of the encoder and each LLM replica runs 2
    for module, per_rank in got.items():
        for layers in per_rank:
            assert len(layers) >= 2, (module, layers)
            for calls, subs in layers:
                # without AC every sub-module runs once per micro-batch; full AC re-runs the layer in
                # backward (torch's non-reentrant checkpoint stops after the last tensor it needs, so
                # the recompute may skip the layer's final sub-modules): strictly more, at most twice
                assert subs * micro < calls <= 2 * subs * micro, (module, calls, subs, got)


def _rng_digest(_worker) -> str:
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


def _advance_rng(_worker) -> None:
    torch.rand(1000)


def test_worker_rng_state_is_restored_at_resume(rig, tmp_path) -> None:
    _, trainer, loader, _ = rig
    trainer.step(next(loader), lr=1e-3)
    trainer.save_modules(str(tmp_path))
    saved = _on_each(trainer, _rng_digest)
    assert len(set(saved["llm"])) == 2  # per-rank streams (dropout & co. differ across ranks)
    _on_each(trainer, _advance_rng)
    assert _on_each(trainer, _rng_digest) != saved
    restored = trainer.load_modules(str(tmp_path))
    assert restored == {"vision": True, "llm": True}
    assert _on_each(trainer, _rng_digest) == saved
