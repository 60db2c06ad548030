"""Which hand-off transport a run uses between a producer group and the loss module's (pure; no torch).

- ``object_store`` (cpu only): Ray's shared-memory object store with zero-copy numpy views. One
  copy of each embedding row per node in the store; every reader on the node maps it.
- ``cuda_ipc`` (cuda, collocated): CUDA IPC handles plus an interprocess event; no bytes move,
  the consumer reads the producer's device memory.
- ``p2p``: a *bridge* of two point-to-point process groups (forward, backward) spanning both
  groups' ranks, built outside the default worlds; NCCL on cuda, gloo on cpu (the same code, so
  CPU tests cover it). Each row crosses once, to the LLM replica's leader, which broadcasts inside
  its TP group. On cuda it needs disjoint GPUs (NCCL cannot put two ranks of one communicator on
  the same GPU), i.e. ``placement=disaggregated``.

``auto`` picks object_store on cpu, cuda_ipc for collocated cuda groups and p2p for disaggregated
cuda groups. A partition placement (``dhp.config.placement``) resolves each edge by whether its two
modules share GPUs (:func:`run_handoff`).
"""

from __future__ import annotations

from dhp.config.placement import COLLOCATED, DISAGGREGATED, Sets, shares_gpus


def resolve_handoff(*, device: str, placement: str, handoff: str) -> tuple[str, str | None]:
    """``(transport, problem)``: the transport ``handoff`` means on this device and placement, and
    a sentence saying why that combination cannot run (None when it can). ``placement`` is one edge's:
    ``collocated`` (its two modules share GPUs) or ``disaggregated`` (:func:`edge_placement`)."""
    shared = placement == COLLOCATED
    if handoff == "auto":
        if device == "cpu":
            return "object_store", None
        return ("cuda_ipc" if shared else "p2p"), None
    if handoff == "object_store" and device != "cpu":
        return handoff, (
            "object_store moves tensors through host memory; on cuda use cuda_ipc (collocated) or p2p "
            "(disaggregated), or handoff=auto"
        )
    if handoff == "cuda_ipc" and (device != "cuda" or not shared):
        return (
            handoff,
            "cuda_ipc needs cluster.device=cuda and placement=collocated (groups on the same GPUs)",
        )
    if handoff == "p2p" and device == "cuda" and shared:
        return handoff, (
            "p2p over NCCL needs the groups on disjoint GPUs (placement=disaggregated); collocated cuda "
            "groups use cuda_ipc"
        )
    return handoff, None


def edge_placement(sets: Sets, producer: str, consumer: str) -> str:
    """``collocated`` when the hand-off edge ``producer -> consumer`` stays on shared GPUs (the two
    modules are in one sharing set), else ``disaggregated``: the placement :func:`resolve_handoff`
    resolves that edge's transport for."""
    return COLLOCATED if shares_gpus(sets, producer, consumer) else DISAGGREGATED


def run_handoff(*, device: str, sets: Sets, consumer: str | None, handoff: str) -> tuple[str, str | None]:
    """``(transport, problem)`` of a run whose modules share GPUs as ``sets`` say: every hand-off edge
    (each other module -> ``consumer``) resolved by :func:`resolve_handoff`; the run has one transport,
    so edges that resolve to different ones are a problem (e.g. on cuda, one producer sharing the
    consumer's GPUs: cuda_ipc, another on GPUs of its own: p2p). No consumer, or no producer: the
    placement of every module together (``collocated`` when they share one set)."""
    producers = [m for group in sets for m in group if m != consumer]
    if consumer is None or not producers:
        return resolve_handoff(
            device=device, placement=COLLOCATED if len(sets) <= 1 else DISAGGREGATED, handoff=handoff
        )
    edges = {p: resolve_handoff(device=device, placement=edge_placement(sets, p, consumer), handoff=handoff)
             for p in producers}  # fmt: skip
    transports = {t for t, _ in edges.values()}
    for p, (t, problem) in edges.items():
        if problem is not None:
            return t, f"{problem} (the edge {p} -> {consumer})"
    if len(transports) > 1:
        by = ", ".join(f"{p} -> {consumer}: {t}" for p, (t, _) in edges.items())
        return sorted(transports)[0], (
            f"the hand-off edges need different transports ({by}) and a run has one. Fix: put every "
            f"producer in {consumer}'s sharing set, or none of them"
        )
    return transports.pop(), None
