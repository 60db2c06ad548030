"""The pipeline schedules' compute order, as torch.distributed.pipelining runs it, and the step it
takes: torch-free, for the planner's bubble.

:func:`rank_orders` lists each pipeline rank's compute actions in torch's order (``("F" | "B" | "I" |
"W", stage, micro-batch)``: forward, full backward, input-gradient and weight-gradient backward):

- ``gpipe``: every forward, then every backward;
- ``1f1b``: ``min(M, pp - r)`` warm-up forwards, then one backward per forward, then the rest of the
  backwards (``Schedule1F1B``);
- ``interleaved_1f1b``: torch's warm-up of ``(v - 1) R + 2 (pp - 1 - r)`` stage forwards (capped at
  ``v M``; ``R`` micro-batches per round), then a forward and a backward per step, the local stages
  taken ``R`` micro-batches at a time, forward in stage order and backward in reverse
  (``ScheduleInterleaved1F1B``);
- ``zero_bubble``: the same with a warm-up of ``(v - 1) R + (pp - 1 - r)``, the backward split into
  its input half (``I``, what the previous stage waits for) and its weight half (``W``), each rank's
  ``W`` deferred by ``r`` steps to fill the bubble (``ScheduleInterleavedZeroBubble``).

:func:`simulate` runs those orders with each action's duration and the dependencies between stages
(a stage's forward after the previous stage's of the same micro-batch, its backward after the next
stage's backward and its own forward, a weight half after its input half) and returns the step's
makespan; :func:`bubble_share` is its idle part over one rank's compute at balanced stages (forward
1, backward 2, split 1 + 1). tests/unit/plan/test_pipeline_torch_order.py holds the orders equal to
torch's own tables.
"""

from __future__ import annotations

from collections import defaultdict

Action = tuple[str, int, int]  # (kind, stage, micro-batch)

#: a backward's cost over its forward's, and the weight half's share of it (balanced stages)
BACKWARD_OVER_FORWARD = 2.0
WEIGHT_SHARE = 0.5


def _rounds(pp: int, m: int) -> int:
    """Micro-batches per round of the interleaved schedules (``m // max(1, m // pp)``)."""
    return m // max(1, m // pp)


def _single(schedule: str, pp: int, m: int, rank: int) -> list[Action]:
    if schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    warmup = min(m, pp - rank)
    out = [("F", rank, i) for i in range(warmup)]
    f = warmup
    for b in range(m):
        out.append(("B", rank, b))
        if f < m:
            out.append(("F", rank, f))
            f += 1
    return out


def _interleaved(pp: int, v: int, m: int, rank: int, *, zero_bubble: bool) -> list[Action]:
    per_round = _rounds(pp, m)
    factor = 1 if zero_bubble else 2
    warmup = min((v - 1) * per_round + factor * (pp - 1 - rank), m * v)
    total = v * m

    def fwd_stage(step: int) -> int:
        return ((step // per_round) % v) * pp + rank

    def bwd_stage(step: int) -> int:
        return (v - 1 - ((step - warmup) // per_round) % v) * pp + rank

    f_mb: dict[int, int] = defaultdict(int)
    b_mb: dict[int, int] = defaultdict(int)
    w_mb: dict[int, int] = defaultdict(int)
    out: list[Action] = []
    backward_ops: list[int] = []
    weights = 0
    kind = "I" if zero_bubble else "B"

    def take(counter: dict[int, int], stage: int) -> int:
        counter[stage] += 1
        return counter[stage] - 1

    def weight() -> None:
        nonlocal weights
        s = bwd_stage(backward_ops[weights])
        out.append(("W", s, take(w_mb, s)))
        weights += 1

    fwd_bwd = total - warmup  # then the cooldown: the warm-up's backwards
    for op in range(total + warmup):
        if op < warmup + fwd_bwd:
            s = fwd_stage(op)
            out.append(("F", s, take(f_mb, s)))
        if op >= warmup:
            s = bwd_stage(op)
            out.append((kind, s, take(b_mb, s)))
            backward_ops.append(op)
            if zero_bubble and op - warmup >= rank:
                weight()
    while zero_bubble and weights < len(backward_ops):
        weight()
    return out


def rank_orders(schedule: str, *, pp: int, virtual: int, micro_batches: int) -> list[list[Action]]:
    """Each pipeline rank's compute actions in torch's order (the module docstring)."""
    m = max(1, micro_batches)
    if schedule in ("gpipe", "1f1b"):
        return [_single(schedule, pp, m, r) for r in range(pp)]
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        return [_interleaved(pp, virtual, m, r, zero_bubble=schedule == "zero_bubble") for r in range(pp)]
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def simulate(orders: list[list[Action]], durations: dict[str, float], *, num_stages: int) -> float:
    """The makespan of ``orders`` (each rank runs its actions in order, each when its dependencies are
    done) with ``durations`` per action kind (``F``, ``B``, ``I``, ``W``), sends taking no time."""
    done: dict[Action, float] = {}
    clock = [0.0] * len(orders)
    nxt = [0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r, order in enumerate(orders):
            while nxt[r] < len(order):
                kind, s, i = order[nxt[r]]
                deps: list[Action] = []
                if kind == "F" and s > 0:
                    deps.append(("F", s - 1, i))
                if kind in ("B", "I"):
                    deps.append(("F", s, i))
                    if s < num_stages - 1:
                        deps += [(k, s + 1, i) for k in ("B", "I") if (k, s + 1, i) in done]
                        if not any((k, s + 1, i) in done for k in ("B", "I")):
                            break
                if kind == "W":
                    deps.append(("I", s, i))
                if any(d not in done for d in deps):
                    break
                start = max([clock[r], *(done[d] for d in deps)])
                clock[r] = done[(kind, s, i)] = start + durations[kind]
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("pipeline schedule order deadlocks (a bug in the order)")
    return max(clock)


def bubble_share(schedule: str, *, pp: int, virtual: int, micro_batches: int) -> float:
    """The step's idle time over one rank's compute, at balanced stages (:func:`simulate`)."""
    if pp <= 1:
        return 0.0
    b = BACKWARD_OVER_FORWARD
    durations = {"F": 1.0, "B": b, "I": b * (1 - WEIGHT_SHARE), "W": b * WEIGHT_SHARE}
    orders = rank_orders(schedule, pp=pp, virtual=virtual, micro_batches=micro_batches)
    busy = virtual * max(1, micro_batches) * (1.0 + b)
    return simulate(orders, durations, num_stages=pp * virtual) / busy - 1.0
