"""A SIGTERM or Ctrl-C at every part of a step is safe, collocated and disaggregated (tiny_vlm, real
Ray and gloo, the shared test Ray).

One chain of runs per placement, each ``train.resume=auto`` from the one before (so the chain is
also the resume test): every run is stopped by a signal sent to the driver from inside one part
of its one step (``DHP_INJECT_FAULT``: the encoder's forward, the driver between two ranks'
submissions of the LLM's call, the hand-off, the LLM's forward and backward, the hand-back, the
gradient sync, the optimizer step, a checkpoint write, an asynchronous one). Each must end within
``STOP_BOUND_S`` of the signal with the signal recorded (the CLI exits 128 + it: 143, 130; the
CLI itself: test_interrupt.py), exactly one complete checkpoint, at the last logged step, no temp
dir and no rank process left. Collocated, two more runs: a signal while the resume loads stops
before a step, leaving the checkpoint as it was; a second signal while the stop's checkpoint is
written stops at once: that save leaves nothing, the previous checkpoint stays the newest. Every
loss logged along the chain (each run after the first resumed from the one before, a step the
hard stop lost logged twice) equals the uninterrupted run's (CPU fp32, same plan: within 1e-6, in
practice bit-equal).
"""

from __future__ import annotations

import signal

import pytest
from interrupts import PLACEMENTS, STOP_BOUND_S, checkpoints, logged, train_with_fault

from dhp.validation import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: (fault, extra overrides) per run of the chain; each stops in the one step it runs
PHASES = [
    ("sigterm:vision/0:produce:1", ()),  # the encoder's forward
    ("sigterm:driver:consume:1", ()),  # between the LLM ranks' submissions of their forward+backward
    ("sigint:llm/0:handoff:1", ()),  # the LLM receiving the encoder's rows
    ("sigterm:llm/1:forward:1", ()),
    ("sigint:llm/0:backward:1", ()),
    ("sigterm:vision/0:handback:1", ()),  # the encoder receiving its gradient rows, its backward
    ("sigint:llm/1:grad_sync:1", ()),
    ("sigterm:vision/0:optimizer:1", ()),
    ("sigterm:llm/0:save:1", ("train.checkpoint_every=1",)),  # the step's own checkpoint, written
    ("sigterm:llm/1:save_async:1", ("train.checkpoint_every=1", "checkpoint.async_save=true")),
]
STEPS = len(PHASES) + 1  # the chain's steps, then the step a hard stop loses


def _cfg(out, placement, *overrides):
    return load_config(
        "tiny_vlm",
        [
            *PLACEMENTS[placement],
            "name=phases",
            f"train.output_dir={out}",
            f"train.steps={STEPS}",
            "train.checkpoint_every=0",
            "train.keep_last=1",
            *overrides,
        ],
    )


def _stopped(run, fault: str) -> None:
    """The run ended on ``fault``'s signal within the bound, leaving no rank process."""
    want = signal.SIGTERM if fault.startswith("sigterm") else signal.SIGINT
    r = run.result
    assert r.interrupted and r.signal == want, (fault, run.console[-2000:])
    assert run.stop_s is not None and run.stop_s < STOP_BOUND_S, (fault, run.stop_s)
    assert not run.orphans, (fault, run.orphans)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_a_signal_in_every_phase_stops_at_a_step_boundary(ray_local, tmp_path_factory, placement) -> None:
    out = tmp_path_factory.mktemp(placement)
    reference = train_with_fault(_cfg(tmp_path_factory.mktemp("ref"), placement), None).result
    assert sorted(reference.losses) == list(range(1, STEPS + 1))
    rows = []  # the first run starts fresh (resume=auto finds nothing), each later one resumes
    for step, (fault, extra) in enumerate(PHASES, start=1):
        run = train_with_fault(_cfg(out, placement, "train.resume=auto", *extra), fault)
        _stopped(run, fault)
        run_dir, done = run.result.run_dir, checkpoints(run.result.run_dir)
        assert done == ([step], []) and max(logged(run_dir)) == step, (fault, done, run.console[-2000:])
        assert run.result.last_checkpoint.name == f"step_{step:06d}", fault
        rows.append((fault, step, max(logged(run_dir)), round(run.stop_s, 1)))
    top = len(PHASES)
    if placement == "collocated":  # what follows does not depend on the placement
        # a signal while the resume loads the checkpoint: no step runs, the checkpoint stays
        fault = "sigterm:driver:load_checkpoint"
        run = train_with_fault(_cfg(out, placement, "train.resume=auto"), fault)
        _stopped(run, fault)
        assert "before a step could run" in run.console, run.console[-2000:]
        assert checkpoints(run_dir) == ([top], []) and max(logged(run_dir)) == top
        rows.append((fault, top, top, round(run.stop_s, 1)))
        # a second signal during the stop's own checkpoint: stop at once, nothing of that save is left
        fault = "sigterm:llm/0:forward:1,sigterm:llm/0:save:1"
        run = train_with_fault(_cfg(out, placement, "train.resume=auto"), fault)
        _stopped(run, fault)
        assert "stopped at once" in run.console, run.console[-2000:]
        assert checkpoints(run_dir) == ([top], []), checkpoints(run_dir)  # the previous one, intact
        assert max(logged(run_dir)) == top + 1
        rows.append((fault, top, top + 1, round(run.stop_s, 1)))
    for step, seen in logged(run_dir).items():  # every resumed run went on as the uninterrupted one
        assert all(abs(x - reference.losses[step]) <= 1e-6 for x in seen), (
            step,
            seen,
            reference.losses[step],
        )
    print(f"\n{placement}: (fault, checkpoint step, last logged step, seconds from signal to return)")
    for row in rows:
        print(f"  {row}")
