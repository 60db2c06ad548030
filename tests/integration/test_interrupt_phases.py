"""A SIGTERM or Ctrl-C at every part of a step is safe, collocated and disaggregated (tiny_vlm, real
Ray and gloo, the shared test Ray).

One chain of runs per placement, each ``train.resume=auto`` from the one before (so the chain is
also the resume test): every run is stopped by a signal sent to the driver from inside one part
of its second step (``DHP_INJECT_FAULT``: the encoder's forward, the driver between two ranks'
submissions of the LLM's call, the hand-off, the LLM's forward and backward, the hand-back, the
gradient sync, the optimizer step, a checkpoint write, an asynchronous one). Each must end within
``STOP_BOUND_S`` of the signal with the signal recorded (the CLI exits 128 + it: 143, 130), exactly
one complete checkpoint, at the last logged step, no temp dir and no rank process left. A signal
while the resume loads stops before a step, leaving the checkpoints as they were. A second signal
while the stop's checkpoint is written stops at once: that save leaves nothing, the previous
checkpoint stays the newest. The last run goes to the end; every logged loss of the chain equals
the uninterrupted run's (CPU fp32, same plan: within 1e-6, in practice bit-equal).
"""

from __future__ import annotations

import signal

import pytest
from interrupts import PLACEMENTS, STOP_BOUND_S, checkpoints, logged, train_with_fault

from dhp.config import load_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: (fault, extra overrides) per run of the chain; each stops in the 2nd step of its life
PHASES = [
    ("sigterm:vision/0:produce:2", ()),  # the encoder's forward
    ("sigterm:driver:consume:2", ()),  # between the LLM ranks' submissions of their forward+backward
    ("sigint:llm/0:handoff:2", ()),  # the LLM receiving the encoder's rows
    ("sigterm:llm/1:forward:2", ()),
    ("sigint:llm/0:backward:2", ()),
    ("sigterm:vision/0:handback:2", ()),  # the encoder receiving its gradient rows, its backward
    ("sigint:llm/1:grad_sync:2", ()),
    ("sigterm:vision/0:optimizer:2", ()),
    ("sigterm:llm/0:save:2", ("train.checkpoint_every=2",)),  # the step's own checkpoint, written
    ("sigterm:llm/1:save_async:2", ("train.checkpoint_every=2", "checkpoint.async_save=true")),
]
STEPS = 2 * len(PHASES) + 4  # the chain's steps, then a hard-stopped pair, then two more


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


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_a_signal_in_every_phase_stops_at_a_step_boundary(ray_local, tmp_path_factory, placement) -> None:
    out = tmp_path_factory.mktemp(placement)
    reference = train_with_fault(_cfg(tmp_path_factory.mktemp("ref"), placement), None).result
    assert sorted(reference.losses) == list(range(1, STEPS + 1))

    rows = []  # the first run starts fresh (resume=auto finds nothing), each later one resumes
    for i, (fault, extra) in enumerate(PHASES):
        run = train_with_fault(_cfg(out, placement, "train.resume=auto", *extra), fault)
        r = run.result
        want = signal.SIGTERM if fault.startswith("sigterm") else signal.SIGINT
        assert r.interrupted and r.signal == want, (fault, run.console[-2000:])
        assert run.stop_s is not None and run.stop_s < STOP_BOUND_S, (fault, run.stop_s)
        assert not run.orphans, (fault, run.orphans)
        done, other = checkpoints(r.run_dir)
        last_logged = max(logged(r.run_dir))
        assert done == [2 * (i + 1)] and not other, (fault, done, other, run.console[-2000:])
        assert done[-1] >= last_logged and r.last_checkpoint.name == f"step_{done[-1]:06d}", fault
        rows.append((fault, done[-1], last_logged, round(run.stop_s, 1)))
    run_dir = r.run_dir
    top = 2 * len(PHASES)

    # a signal while the resume loads the checkpoint: no step runs, the checkpoint stays
    run = train_with_fault(_cfg(out, placement, "train.resume=auto"), "sigterm:driver:load_checkpoint")
    assert run.result.interrupted and run.result.signal == signal.SIGTERM
    assert "before a step could run" in run.console, run.console[-2000:]
    assert checkpoints(run_dir) == ([top], []) and max(logged(run_dir)) == top and not run.orphans
    rows.append(("sigterm:driver:load_checkpoint", top, top, round(run.stop_s, 1)))

    # a second signal during the stop's own checkpoint: stop at once, nothing of that save is left
    two = "sigterm:llm/0:forward:2,sigterm:llm/0:save:2"
    run = train_with_fault(_cfg(out, placement, "train.resume=auto"), two)
    assert run.result.interrupted and run.result.signal == signal.SIGTERM
    assert "stopped at once" in run.console, run.console[-2000:]
    assert checkpoints(run_dir) == ([top], []), checkpoints(run_dir)  # the previous one, intact
    assert max(logged(run_dir)) == top + 2 and run.stop_s < STOP_BOUND_S and not run.orphans
    rows.append((two, top, top + 2, round(run.stop_s, 1)))

    # the last run goes to the end; every step logged on the way equals the uninterrupted run
    last = train_with_fault(_cfg(out, placement, "train.resume=auto"), None).result
    assert not last.interrupted and last.run_dir == run_dir
    losses = logged(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, seen in losses.items():
        assert all(abs(x - reference.losses[step]) <= 1e-6 for x in seen), (
            step,
            seen,
            reference.losses[step],
        )
    print(f"\n{placement}: (fault, checkpoint step, last logged step, seconds from signal to return)")
    for row in rows:
        print(f"  {row}")
