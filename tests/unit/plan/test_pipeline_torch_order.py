"""The planner's in-flight micro-batch counts are torch.distributed.pipelining's own.

Each schedule's action table (``pipeline_order`` of the multi-stage schedules, ``_get_pipeline_order``
of the single-stage ones) is built for stand-in stages (no process group: a table is pure arithmetic
over the stage indices) and replayed per rank: a forward saves one stage micro-batch, a full backward
or a weight-gradient pass frees it. The peak per rank must equal ``dhp.plan.pipeline.in_flight_stages``.
"""

from __future__ import annotations

import pytest

from dhp.config.plan_space import pipeline_micro_batches
from dhp.layout import ParallelLayout
from dhp.plan.pipeline import in_flight_stages

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
C = schedules._ComputationType

pytestmark = pytest.mark.unit


class _Stage:
    """The attributes a schedule reads to build its table."""

    def __init__(self, index: int, stages: int, pp: int, rank: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, pp, rank
        self.is_first, self.is_last, self.submod = index == 0, index == stages - 1, None


def _peaks(order: dict) -> dict[int, int]:
    out = {}
    for rank, actions in order.items():
        live = best = 0
        for a in actions:
            if a is None:
                continue
            if a.computation_type == C.FORWARD:
                live += 1
            elif a.computation_type in (C.FULL_BACKWARD, C.BACKWARD_WEIGHT):
                live -= 1
            best = max(best, live)
        out[rank] = best
    return out


def _torch_order(name: str, pp: int, v: int, m: int) -> dict | None:
    """The schedule's table, or None where torch refuses ``m`` micro-batches."""
    try:
        if name in ("gpipe", "1f1b"):
            cls = schedules.ScheduleGPipe if name == "gpipe" else schedules.Schedule1F1B
            return {r: cls(_Stage(r, pp, pp, r), m)._get_pipeline_order()[r] for r in range(pp)}
        cls = {"interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
               "zero_bubble": schedules.ScheduleInterleavedZeroBubble}[name]  # fmt: skip
        return cls([_Stage(k * pp, pp * v, pp, 0) for k in range(v)], m).pipeline_order
    except ValueError:
        return None


CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zero_bubble", 2)]


@pytest.mark.parametrize(("name", "v"), CASES)
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_in_flight_equals_torchs_action_table(name: str, v: int, pp: int) -> None:
    for m in range(1, 3 * pp + 2):
        order = _torch_order(name, pp, v, m)
        lay = ParallelLayout(pp=pp, pp_virtual=v, pp_schedule=name)
        # the micro-batch rule refuses exactly what torch refuses
        assert (order is None) == (pipeline_micro_batches(lay, m) is not None), (name, pp, v, m)
        if order is None:
            continue
        want = {r: in_flight_stages(name, pp=pp, virtual=v, micro_batches=m, rank=r) for r in range(pp)}
        assert _peaks(order) == want, (name, pp, v, m)


_KIND = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


@pytest.mark.parametrize(("name", "v"), CASES)
def test_the_planner_runs_each_schedule_in_torchs_order(name: str, v: int) -> None:
    """``dhp.plan.pipeline_sim.rank_orders`` is torch's table, idle slots (and the gradient reductions
    it lists after the last backward) aside, for the multi-stage schedules, whose runtime executes that
    table (1F1B's and GPipe's are their ``_step_microbatches`` loops); its simulated bubble at
    balanced stages is the planner's ``bubble_fraction``."""
    from dhp.plan.pipeline import bubble_fraction
    from dhp.plan.pipeline_sim import bubble_share, rank_orders

    compared = 0
    for pp in (2, 3, 4):
        for m in range(1, 3 * pp + 2):
            order = _torch_order(name, pp, v, m)
            if order is None:
                continue
            want = [[(_KIND[a.computation_type.name], a.stage_index, a.microbatch_index) for a in order[r]
                     if a is not None and a.computation_type.name in _KIND] for r in range(pp)]  # fmt: skip
            if v > 1:  # the single-stage schedules' tables draw 1F1B loosely; their runtime is the order
                assert rank_orders(name, pp=pp, virtual=v, micro_batches=m) == want, (name, pp, v, m)
            lay = ParallelLayout(pp=pp, pp_virtual=v, pp_schedule=name)
            sim = bubble_share(name, pp=pp, virtual=v, micro_batches=m)
            if m % pp == 0:  # whole rounds: the formula's case
                assert sim == pytest.approx(bubble_fraction(lay, micro_batches=m), rel=1e-9), (name, pp, v, m)
            compared += 1
    assert compared >= 10
