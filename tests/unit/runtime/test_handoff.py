"""Hand-off routing (pure) and the CPU transport: every image-token row reaches its LLM replica once."""

import pytest
import torch

from dhp.errors import RuntimeFailure
from dhp.models import get_family
from dhp.plan.placement import GroupLayout, routing
from dhp.runtime.dispatch import RankLayout
from dhp.runtime.handoff import assign_images, route_micro_batch, unit_senders
from dhp.runtime.transport import CpuTransport

pytestmark = pytest.mark.unit

ARCH = get_family("qwen2_5_vl").tiny_model_config().vision
ROW = ARCH.in_channels * ARCH.temporal_patch_size * ARCH.patch_size**2


def _images(grids):
    g = torch.tensor(grids, dtype=torch.long)
    return torch.randn(int(g.prod(dim=1).sum()), ROW), g


def test_assign_images_balances_contiguous_blocks():
    assert assign_images([64, 64, 64, 64], parts=2) == [0, 2, 4]
    assert assign_images([256, 16, 16], parts=2) == [0, 1, 3]
    assert assign_images([64], parts=3) == [0, 0, 1, 1]  # fewer images than parts: empty blocks


@pytest.mark.parametrize(("vision_replicas", "sp"), [(1, 2), (2, 1), (3, 1), (1, 1)])
def test_every_row_reaches_its_replica_exactly_once(vision_replicas, sp):
    batches = [_images([[1, 8, 8], [1, 4, 8]]), _images([[1, 16, 8]]), (None, None)]
    routing = route_micro_batch(
        pixel_values=[b[0] for b in batches],
        image_grid_thw=[b[1] for b in batches],
        vision_replicas=vision_replicas,
        sp_size=sp,
        arch=ARCH,
    )
    assert routing.llm_tokens == (16 + 8, 32, 0)  # merge 2x2: patches / 4
    assert len(routing.vision) == vision_replicas * sp
    for j, n in enumerate(routing.llm_tokens):
        got = torch.cat(
            [r.dst for w in routing.vision for r in w.routes if r.llm_replica == j] or [torch.zeros(0)]
        )
        assert sorted(got.tolist()) == list(range(n)), f"replica {j}"
    for w in routing.vision:  # each local output row goes to exactly one place
        src = torch.cat([r.src for r in w.routes]) if w.routes else torch.zeros(0, dtype=torch.long)
        assert sorted(src.tolist()) == list(range(w.num_tokens))
    assert routing.sources_of(2) == []


@pytest.mark.parametrize(
    ("vision", "llm"),
    [
        ({"dp": 2, "tp": 2}, {"fsdp": 2, "tp": 2}),  # vision units 0, 1 sit on ranks 0 and 2
        ({"dp": 2, "sp": 2}, {"fsdp": 2, "tp": 2}),
        ({"dp": 2, "sp": 2, "tp": 2}, {"dp": 2}),
        ({"tp": 2}, {"tp": 2}),
    ],
)
def test_each_llm_replica_reads_every_row_once_from_tp_rank_0_of_its_units(vision, llm):
    v_layout, l_layout = RankLayout.from_mesh(vision), RankLayout.from_mesh(llm)
    batches = [_images([[1, 8, 8], [1, 8, 8]]) for _ in range(l_layout.num_replicas)]  # equal shares
    r = route_micro_batch(
        pixel_values=[b[0] for b in batches],
        image_grid_thw=[b[1] for b in batches],
        vision_replicas=v_layout.num_replicas,
        sp_size=vision.get("sp", 1),
        arch=ARCH,
    )
    degrees = lambda m: {a: m.get(a, 1) for a in ("dp", "fsdp", "sp", "tp")}  # noqa: E731
    planned = routing(GroupLayout("vision", degrees(vision)), GroupLayout("llm", degrees(llm)))
    for j in range(l_layout.num_replicas):
        senders = unit_senders(r, j, v_layout)
        assert len(senders) == v_layout.num_units
        rows = []
        for u, rank in enumerate(senders):
            if rank is None:
                continue
            assert v_layout.unit_of(rank) == u and rank % vision.get("tp", 1) == 0  # TP rank 0 sends
            rows += [x for w in r.vision[u].routes if w.llm_replica == j for x in w.dst.tolist()]
        assert sorted(rows) == list(range(r.llm_tokens[j])), f"replica {j}"
        # the planner's routing names the same encoder ranks for this replica (equal shares)
        plan_ranks = set(planned[j].vision_ranks)
        assert {s for s in senders if s is not None} <= plan_ranks
        assert {v_layout.replica_of(s) for s in senders if s is not None} == set(planned[j].vision_replicas)


def test_unit_count_mismatch_is_a_routing_error():
    pv, g = _images([[1, 8, 8]])
    r = route_micro_batch(pixel_values=[pv], image_grid_thw=[g], vision_replicas=2, sp_size=1, arch=ARCH)
    with pytest.raises(RuntimeFailure, match="2 vision units, the vision group has 4"):
        unit_senders(r, 0, RankLayout.from_mesh({"dp": 2, "sp": 2}))


def test_cpu_transport_is_zero_copy_on_pack():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    packed = CpuTransport().pack(t)
    assert packed.ctypes.data == t.data_ptr()  # a view, not a copy
    assert torch.equal(CpuTransport().unpack(packed, device=torch.device("cpu")), t)


def test_a_rank_without_tokens_still_gets_its_shard():
    # one 8x8 image = one 64-patch window: SP rank 1 has no tokens but must still run the
    # full-attention all-to-alls with its peer, so it gets an (empty) shard, never None
    pv, g = _images([[1, 8, 8]])
    routing = route_micro_batch(
        pixel_values=[pv], image_grid_thw=[g], vision_replicas=1, sp_size=2, arch=ARCH
    )
    assert [w.shard is not None for w in routing.vision] == [True, True]
    assert [w.num_tokens for w in routing.vision] == [16, 0] and routing.vision[1].routes == ()


def test_handoff_resolves_by_device_and_placement():
    from dhp.config.handoff import resolve_handoff
    from dhp.errors import PlanError
    from dhp.runtime.transport import CudaIpcTransport, make_transport

    def resolve(device: str, placement: str, handoff: str = "auto") -> tuple[str, str | None]:
        return resolve_handoff(device=device, placement=placement, handoff=handoff)

    assert resolve("cpu", "collocated") == ("object_store", None)
    assert resolve("cpu", "disaggregated") == ("object_store", None)
    assert resolve("cuda", "collocated") == ("cuda_ipc", None)
    assert resolve("cuda", "disaggregated") == ("p2p", None)  # the NCCL bridge, never host memory
    assert resolve("cpu", "collocated", "p2p") == ("p2p", None)  # gloo bridge: how CPU tests cover it
    assert "disjoint GPUs" in resolve("cuda", "collocated", "p2p")[1]
    assert "host memory" in resolve("cuda", "disaggregated", "object_store")[1]
    assert "collocated" in resolve("cuda", "disaggregated", "cuda_ipc")[1]
    assert isinstance(make_transport("object_store"), CpuTransport)
    assert isinstance(make_transport("cuda_ipc"), CudaIpcTransport)
    assert make_transport("p2p") is None
    with pytest.raises(PlanError, match="unknown hand-off"):
        make_transport("auto")  # only resolved names reach the workers


def test_fsdp_pads_a_vision_replica_without_images():
    """Two vision replicas, one image: with pad_empty the idle replica gets a blank one-merge-unit
    image on every SP rank and sends nothing (FSDP's collectives must run on every replica)."""
    pv, g = _images([[1, 8, 8]])
    kw = {"pixel_values": [pv], "image_grid_thw": [g], "vision_replicas": 2, "sp_size": 2, "arch": ARCH}
    plain = route_micro_batch(**kw)
    idle = [u for u, w in enumerate(plain.vision) if w.shard is None]
    assert len(idle) == 2  # one replica's 2 SP ranks
    padded = route_micro_batch(**kw, pad_empty=True)
    busy = [u for u in range(4) if u not in idle]
    assert all(
        padded.vision[u] is plain.vision[u] or padded.vision[u].num_tokens == plain.vision[u].num_tokens
        for u in busy
    )
    blank = [padded.vision[u] for u in idle]
    assert all(w.shard is not None and w.routes == () for w in blank)
    assert sum(w.shard.num_patches for w in blank) == ARCH.spatial_merge_size**2
    assert all(float(w.shard.pixel_values.abs().sum()) == 0.0 for w in blank)
    assert padded.sources_of(0) == plain.sources_of(0)
