"""Hand-off routing (pure) and the CPU transport: every image-token row reaches its LLM replica once."""

import pytest
import torch

from dhp.errors import RuntimeFailure
from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.plan.placement import routing
from dhp.runtime.handoff.routing import assign_images, route_micro_batch, unit_senders
from dhp.runtime.handoff.transport import CpuTransport

pytestmark = pytest.mark.unit

FAMILY = get_family("qwen2_5_vl")
HF = FAMILY.hf_config(FAMILY.tiny_model_config())
ARCH = FAMILY.tiny_model_config().vision
ROW = ARCH.in_channels * ARCH.temporal_patch_size * ARCH.patch_size**2


def _serving(vision_replicas: int, llm_replicas: int) -> list[tuple[int, ...]]:
    """The plan's routing (dhp.plan.placement.routing): producer replicas serving each LLM replica."""
    deg = lambda dp: {"dp": dp, "fsdp": 1, "sp": 1, "tp": 1}  # noqa: E731
    routes = routing(
        ParallelLayout.from_config(deg(vision_replicas)), ParallelLayout.from_config(deg(llm_replicas))
    )
    return [r.producer_replicas for r in routes]


def route(*, pixel_values, image_grid_thw, vision_replicas, sp_size, pad_empty=False):
    """``route_micro_batch`` with the tiny family's SP cut and the plan's routing."""
    return route_micro_batch(
        rows=pixel_values,
        meta=image_grid_thw,
        serving=_serving(vision_replicas, len(pixel_values)),
        producer_replicas=vision_replicas,
        sp_size=sp_size,
        shard_fn=lambda pv, g, n: FAMILY.shard_inputs(
            "vision", HF, pixel_values=pv, image_grid_thw=g, sp_size=n
        ),
        tokens_per_item=lambda g: FAMILY.tokens_per_image(HF, g),
        blank=FAMILY.blank_image(HF) if pad_empty else None,
    )


def _images(grids):
    g = torch.tensor(grids, dtype=torch.long)
    return torch.randn(int(g.prod(dim=1).sum()), ROW), g


def test_assign_images_balances_contiguous_blocks():
    assert assign_images([64, 64, 64, 64], parts=2) == [0, 2, 4]
    assert assign_images([256, 16, 16], parts=2) == [0, 1, 3]
    assert assign_images([64], parts=3) == [0, 0, 1, 1]  # fewer images than parts: empty blocks


@pytest.mark.parametrize(("vision_replicas", "sp"), [(1, 2), (3, 1), (1, 1)])
def test_every_row_reaches_its_replica_exactly_once(vision_replicas, sp):
    batches = [_images([[1, 8, 8], [1, 4, 8]]), _images([[1, 16, 8]]), (None, None)]
    routing_ = route(
        pixel_values=[b[0] for b in batches],
        image_grid_thw=[b[1] for b in batches],
        vision_replicas=vision_replicas,
        sp_size=sp,
    )
    assert routing_.consumer_rows == (16 + 8, 32, 0)  # merge 2x2: patches / 4
    assert len(routing_.units) == vision_replicas * sp
    for j, n in enumerate(routing_.consumer_rows):
        got = torch.cat(
            [r.dst for w in routing_.units for r in w.routes if r.endpoint == j] or [torch.zeros(0)]
        )
        assert sorted(got.tolist()) == list(range(n)), f"replica {j}"
    for w in routing_.units:  # each local output row goes to exactly one place
        src = torch.cat([r.src for r in w.routes]) if w.routes else torch.zeros(0, dtype=torch.long)
        assert sorted(src.tolist()) == list(range(w.num_tokens))
    assert routing_.sources_of(2) == []


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
    v_layout, l_layout = ParallelLayout.from_config(vision), ParallelLayout.from_config(llm)
    batches = [_images([[1, 8, 8], [1, 8, 8]]) for _ in range(l_layout.num_replicas)]  # equal shares
    r = route(
        pixel_values=[b[0] for b in batches],
        image_grid_thw=[b[1] for b in batches],
        vision_replicas=v_layout.num_replicas,
        sp_size=vision.get("sp", 1),
    )
    degrees = lambda m: {a: m.get(a, 1) for a in ("dp", "fsdp", "sp", "tp")}  # noqa: E731
    planned = routing(ParallelLayout.from_config(degrees(vision)), ParallelLayout.from_config(degrees(llm)))
    for j in range(l_layout.num_replicas):
        senders = unit_senders(r, j, v_layout)
        assert len(senders) == v_layout.num_units
        rows = []
        for u, rank in enumerate(senders):
            if rank is None:
                continue
            assert v_layout.unit_of(rank) == u and rank % vision.get("tp", 1) == 0  # TP rank 0 sends
            rows += [x for w in r.units[u].routes if w.endpoint == j for x in w.dst.tolist()]
        assert sorted(rows) == list(range(r.consumer_rows[j])), f"replica {j}"
        # the runtime routes by the planner's routing: exactly its encoder ranks for this replica
        plan_ranks = set(planned[j].producer_ranks)
        assert {s for s in senders if s is not None} <= plan_ranks
        assert {v_layout.replica_of(s) for s in senders if s is not None} == set(planned[j].producer_replicas)


def test_unit_count_mismatch_is_a_routing_error():
    pv, g = _images([[1, 8, 8]])
    r = route(pixel_values=[pv], image_grid_thw=[g], vision_replicas=2, sp_size=1)
    with pytest.raises(RuntimeFailure, match="2 producer units, the producer group has 4"):
        unit_senders(r, 0, ParallelLayout.from_config({"dp": 2, "sp": 2}))


def test_cpu_transport_is_zero_copy_on_pack():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    packed = CpuTransport().pack(t)
    assert packed.ctypes.data == t.data_ptr()  # a view, not a copy
    assert torch.equal(CpuTransport().unpack(packed, device=torch.device("cpu")), t)


def test_cpu_transport_carries_bf16_rows_zero_copy():
    # numpy has no bfloat16: the rows' bits travel as int16 (2 bytes per element, no copy) and come
    # back bit for bit as bfloat16 (what both bf16 precision policies hand off)
    t = torch.randn(3, 4).to(torch.bfloat16)
    packed = CpuTransport().pack(t)
    assert packed.bits.ctypes.data == t.data_ptr() and packed.bits.nbytes == t.numel() * 2
    back = CpuTransport().unpack(packed, device=torch.device("cpu"))
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)


def test_a_rank_without_tokens_still_gets_its_shard():
    # one 8x8 image = one 64-patch window: SP rank 1 has no tokens but must still run the
    # full-attention all-to-alls with its peer, so it gets an (empty) shard, never None
    pv, g = _images([[1, 8, 8]])
    r = route(pixel_values=[pv], image_grid_thw=[g], vision_replicas=1, sp_size=2)
    assert [w.shard is not None for w in r.units] == [True, True]
    assert [w.num_tokens for w in r.units] == [16, 0] and r.units[1].routes == ()


def test_handoff_resolves_by_device_and_placement():
    from dhp.config.handoff import resolve_handoff
    from dhp.errors import PlanError
    from dhp.runtime.handoff.transport import CudaIpcTransport, make_transport

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
    assert make_transport("p2p").leader_only
    with pytest.raises(PlanError, match="unknown hand-off"):
        make_transport("auto")  # only resolved names reach the workers


def test_fsdp_pads_a_vision_replica_without_images():
    """Two vision replicas, one image: with pad_empty the idle replica gets a blank one-merge-unit
    image on every SP rank and sends nothing (FSDP's collectives must run on every replica)."""
    pv, g = _images([[1, 8, 8]])
    kw = {"pixel_values": [pv, None], "image_grid_thw": [g, None], "vision_replicas": 2, "sp_size": 2}
    plain = route(**kw)
    idle = [u for u, w in enumerate(plain.units) if w.shard is None]
    assert len(idle) == 2  # one replica's 2 SP ranks
    padded = route(**kw, pad_empty=True)
    busy = [u for u in range(4) if u not in idle]
    assert all(
        padded.units[u] is plain.units[u] or padded.units[u].num_tokens == plain.units[u].num_tokens
        for u in busy
    )
    blank = [padded.units[u] for u in idle]
    assert all(w.shard is not None and w.routes == () for w in blank)
    assert sum(w.shard.num_patches for w in blank) == ARCH.spatial_merge_size**2
    assert all(float(w.shard.pixel_values.abs().sum()) == 0.0 for w in blank)
    assert padded.sources_of(0) == plain.sources_of(0)
