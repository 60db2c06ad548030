"""Which hand-off transport a run uses between the vision and LLM groups (pure; no torch).

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
cuda groups.
"""

from __future__ import annotations


def resolve_handoff(*, device: str, placement: str, handoff: str) -> tuple[str, str | None]:
    """``(transport, problem)``: the transport ``handoff`` means on this device and placement, and
    a sentence saying why that combination cannot run (None when it can)."""
    if handoff == "auto":
        if device == "cpu":
            return "object_store", None
        return ("cuda_ipc" if placement == "collocated" else "p2p"), None
    if handoff == "object_store" and device != "cpu":
        return handoff, (
            "object_store moves tensors through host memory; on cuda use cuda_ipc (collocated) or p2p "
            "(disaggregated), or handoff=auto"
        )
    if handoff == "cuda_ipc" and (device != "cuda" or placement != "collocated"):
        return (
            handoff,
            "cuda_ipc needs cluster.device=cuda and placement=collocated (groups on the same GPUs)",
        )
    if handoff == "p2p" and device == "cuda" and placement != "disaggregated":
        return handoff, (
            "p2p over NCCL needs the groups on disjoint GPUs (placement=disaggregated); collocated cuda "
            "groups use cuda_ipc"
        )
    return handoff, None
