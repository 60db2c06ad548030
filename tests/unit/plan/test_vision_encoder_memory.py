"""What the Qwen3 vision encoder (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5) saves for backward is what the
planner counts from its declared architecture: an ungated MLP (2 MLP widths per token and block, not
a SwiGLU's 4) and one side merger per DeepStack level (norm, matmul and activation outputs: 3 merged
rows per ``merge`` patches).

The family's own vision module (transformers' ``Qwen3VLVisionModel`` in dhp's wrapper, what a rank
runs) does one forward under a saved-tensors hook that collects the storages autograd keeps
(parameters excluded, each storage once, as ``dhp.metrics.accounting`` counts them), at sizes that
move each term: the MLP width, the DeepStack levels, depth and hidden.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from dhp.config.schema import ModuleConfig
from dhp.layout import module_layout
from dhp.models.entries import model_entry
from dhp.models.registry import get_family
from dhp.plan.memory import activations_of, module_shape

pytestmark = pytest.mark.unit

PATCHES = 256  # one 16x16-patch image


def _saved_bytes(module: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(pixels, grid)
    return sum(saved.values())


@pytest.mark.parametrize(
    ("hidden", "mlp", "depth", "deepstack"),
    [(32, 64, 3, [0, 1]), (32, 256, 3, []), (64, 64, 4, [1, 2, 3]), (64, 128, 2, [0])],
)
def test_encoder_saved_bytes_match_the_plan(hidden: int, mlp: int, depth: int, deepstack: list[int]) -> None:
    model = OmegaConf.merge(
        OmegaConf.structured(model_entry("tiny_qwen3_vl")),
        {
            "vision": {
                "hidden_size": hidden,
                "intermediate_size": mlp,
                "depth": depth,
                "extra": {"deepstack_visual_indexes": deepstack},
            },
            "llm": {"num_layers": 4},
        },
    )
    family = get_family("qwen3_vl")
    hf = family.hf_config(model)
    torch.manual_seed(0)
    vision = family.build_module("vision", hf, device="cpu", dtype=torch.float32)
    row = model.vision.in_channels * model.vision.temporal_patch_size * model.vision.patch_size**2
    side = int(PATCHES**0.5)
    measured = _saved_bytes(vision, torch.randn(PATCHES, row), torch.tensor([[1, side, side]]))

    module = OmegaConf.merge(
        OmegaConf.structured(ModuleConfig),
        {"parallel": {"dp": 1, "fsdp": 1, "sp": 1, "tp": 1}, "seq_len": PATCHES, "mixed_precision": "fp32"},
    )
    shape = module_shape(
        "vision",
        model=model,
        module=module,
        layout=module_layout(module),
        micro_batch=1,
        image_patches=PATCHES,
    )
    predicted = sum(activations_of(shape).values())
    # within 2 %: these settings agree within 0.5 % (what is left: norm statistics, rotary tables and
    # the position-table taps); a SwiGLU's 4 MLP widths or a missed DeepStack merger is 6-25 % here
    assert measured == pytest.approx(predicted, rel=0.02)


def test_an_encoder_replica_serving_two_llm_replicas_is_planned_for_both_their_images() -> None:
    """With one encoder replica and two LLM replicas, the encoder encodes both replicas' images in
    one forward per driver micro-batch (``dhp.plan.placement.routing``): ``modules.vision.seq_len``
    bounds one LLM replica's micro-batch, so the planner counts twice that, for memory and time."""
    from dhp.plan import compile_plan
    from dhp.validation import load_config

    common = [
        "placement=disaggregated",
        "modules.vision.gpus=1",
        "modules.vision.parallel.sp=1",
        f"data.synthetic.patches={PATCHES}",
        "data.synthetic.images_per_sample=1",
        f"modules.vision.seq_len={PATCHES}",
        "train.micro_batch_size=1",
    ]
    two = load_config("tiny_qwen3_vl_moe", [*common, "train.global_batch_size=2"])  # llm dp=2
    one = load_config(
        "tiny_qwen3_vl_moe",
        [*common, "train.global_batch_size=1", "modules.llm.gpus=1", "modules.llm.parallel.dp=1",
         "modules.llm.parallel.ep=1"],
    )  # fmt: skip
    family = get_family("qwen3_vl_moe")
    torch.manual_seed(0)
    vision = family.build_module("vision", family.hf_config(two.model), device="cpu", dtype=torch.float32)
    v = two.model.vision
    row = v.in_channels * v.temporal_patch_size * v.patch_size**2
    side = int(PATCHES**0.5)
    measured = _saved_bytes(vision, torch.randn(2 * PATCHES, row), torch.tensor([[1, side, side]] * 2))
    plans = {n: compile_plan(cfg) for n, cfg in (("two", two), ("one", one))}
    planned = {n: p.group("vision").ranks[0].memory.detail for n, p in plans.items()}
    assert measured == pytest.approx(sum(planned["two"].values()), rel=0.10)
    assert sum(planned["two"].values()) == pytest.approx(2 * sum(planned["one"].values()), rel=0.01)
    # time: the estimate's vision FLOPs are those of every patch it counts in its throughput
    est = {n: p.estimate for n, p in plans.items()}
    for n, e in est.items():
        patches_per_mb = e["vision_tokens_per_s"] * e["step_time_s"] / e["micro_batches"]
        assert patches_per_mb == pytest.approx(PATCHES * (2 if n == "two" else 1))
    flops = {n: e["modules"]["vision"]["tflops_per_rank"] / e["micro_batches"] for n, e in est.items()}
    assert flops["two"] == pytest.approx(2 * flops["one"], rel=0.01)


def test_the_30b_plans_vision_flops_of_the_patches_it_counts_in_its_throughput() -> None:
    """``dhp plan conf=qwen3_vl_30b_a3b --json``: 8 LLM replicas per encoder replica. The vision
    TFLOPs the plan charges its ranks are the PaLM FLOPs of the vision tokens its own throughput
    counts per step (131K patches; within the planner's extra terms: the merger, the patch rows,
    DeepStack), not of the 16K patches of one LLM replica's micro-batch."""
    import json

    from dhp.models.arch import palm_flops
    from dhp.plan import compile_plan
    from dhp.plan.params import architecture
    from dhp.validation import load_config

    # without the recipe's full checkpointing of the encoder, whose recompute adds a forward (x 4/3)
    cfg = load_config("qwen3_vl_30b_a3b", ["modules.vision.activation_checkpointing=off"])
    plan = compile_plan(cfg)
    doc = json.loads(plan.to_json_str())["estimate"]
    patches = doc["vision_tokens_per_s"] * doc["step_time_s"]
    syn = cfg.data.synthetic
    assert patches == pytest.approx(cfg.train.global_batch_size * syn.images_per_sample * syn.patches)
    palm = palm_flops(architecture(cfg.model).modules["vision"], [syn.patches] * round(patches / syn.patches),
                      frozen=False)  # fmt: skip
    charged = doc["modules"]["vision"]["tflops_per_rank"] * 1e12 * plan.group("vision").world_size
    assert 1.0 <= charged / palm <= 1.12


def test_full_checkpointing_of_the_encoder_charges_one_more_forward() -> None:
    """The recipe's own plan (vision AC full): the same patches cost up to 4/3 of the TFLOPs of AC off
    (the blocks' recompute is a second forward of the blocks; forward + backward is 3 forwards). The
    patch embedding and the merger sit outside the checkpointed blocks, so the ratio is a little under."""
    import json

    from dhp.plan import compile_plan
    from dhp.validation import load_config

    tflops = {}
    for mode in ("off", "full"):
        cfg = load_config("qwen3_vl_30b_a3b", [f"modules.vision.activation_checkpointing={mode}"])
        doc = json.loads(compile_plan(cfg).to_json_str())["estimate"]
        tflops[mode] = doc["modules"]["vision"]["tflops_per_rank"]
    assert 1.25 <= tflops["full"] / tflops["off"] <= 4 / 3 + 1e-9
