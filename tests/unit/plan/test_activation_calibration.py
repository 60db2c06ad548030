"""Calibrate the activation formulas against what autograd really saves in transformers' model.

A ``saved_tensors_hooks`` pack hook records every tensor autograd keeps for backward during one
forward of the real Qwen2.5-VL modules (fp32, sdpa, CPU); parameters are excluded and storages
are counted once. The planner's estimate for the same shapes must agree within 10%: it is a
planning model, so a tighter bound would pin incidental details of transformers' code.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from dhp.config.schema import ModuleConfig
from dhp.layout import module_layout
from dhp.plan.memory import activations_of, module_shape

pytestmark = pytest.mark.unit

TOLERANCE = 0.10  # relative; see the module docstring
ARCH = {
    "vision": {
        "depth": 4,
        "hidden_size": 128,
        "num_heads": 4,
        "intermediate_size": 344,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
        "extra": {"window_size": 112, "fullatt_block_indexes": [1, 3]},
    },
    "llm": {
        "hidden_size": 256,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 688,
        "vocab_size": 1024,
        "tie_word_embeddings": False,
        "extra": {"mrope_section": [8, 12, 12]},
        "max_position_embeddings": 4096,
    },
}


@pytest.fixture(scope="module")
def hf_model():
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    v, t = ARCH["vision"], ARCH["llm"]
    cfg = Qwen2_5_VLConfig(
        vision_config={**v, "out_hidden_size": t["hidden_size"]},
        text_config={
            "hidden_size": t["hidden_size"],
            "num_hidden_layers": t["num_layers"],
            "num_attention_heads": t["num_heads"],
            "num_key_value_heads": t["num_kv_heads"],
            "intermediate_size": t["intermediate_size"],
            "vocab_size": t["vocab_size"],
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 0,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": t["extra"]["mrope_section"],
                "rope_theta": 1e6,
            },
        },
        attn_implementation="sdpa",
    )
    return Qwen2_5_VLForConditionalGeneration(cfg).float()


def _saved_bytes(model, run) -> int:
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _shape(name: str, seq_len: int):
    model = OmegaConf.create(
        {
            "family": "qwen2_5_vl",
            "dtype": "float32",
            "attn_implementation": "sdpa",
            "vision": ARCH["vision"],
            "llm": ARCH["llm"],
        }
    )
    module = OmegaConf.merge(
        OmegaConf.structured(ModuleConfig),
        {
            "parallel": {"dp": 1, "fsdp": 1, "sp": 1, "tp": 1, "zero": 0},
            "seq_len": seq_len,
            "activation_checkpointing": False,
            "loss_chunk_tokens": 0,
            "freeze": False,
            "mixed_precision": "fp32",
        },
    )
    return model, module_shape(name, model=model, module=module, layout=module_layout(module), micro_batch=1)


def test_llm_layers_match_saved_tensors(hf_model) -> None:
    import torch

    seq = 512
    lm = hf_model.model.language_model
    embeds = torch.randn(1, seq, ARCH["llm"]["hidden_size"], requires_grad=True)
    positions = torch.arange(seq).view(1, 1, seq).expand(3, 1, seq)
    measured = _saved_bytes(hf_model, lambda: lm(inputs_embeds=embeds, position_ids=positions))
    _, shape = _shape("llm", seq)
    detail = activations_of(shape)
    estimate = detail["layers"] + detail["final_norm"]
    assert estimate == pytest.approx(measured, rel=TOLERANCE)


def test_vision_encoder_matches_saved_tensors(hf_model) -> None:
    import torch

    grid = torch.tensor([[1, 32, 32]])  # one 448x448 image: 1024 patches, 16 windows of 64
    pixels = torch.randn(1024, 3 * 2 * 14 * 14)
    measured = _saved_bytes(hf_model, lambda: hf_model.model.visual(pixels, grid_thw=grid))
    _, shape = _shape("vision", 1024)
    estimate = sum(activations_of(shape).values())
    assert estimate == pytest.approx(measured, rel=TOLERANCE)


def test_flops_match_torch_flop_counter(hf_model) -> None:
    """The planner's forward FLOPs against torch's FlopCounterMode on the real modules.

    On CPU, FlopCounterMode registers no FLOPs for the sdpa kernel transformers calls, so this pins
    the matmul part exactly (2 FLOPs per multiply-accumulate; ``language_model`` has no lm_head);
    the attention formula is pinned against a written formula in test_plan_terms.py.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from dhp.plan.timing import module_flops

    seq = 128
    lm = hf_model.model.language_model
    embeds = torch.randn(1, seq, ARCH["llm"]["hidden_size"])
    positions = torch.arange(seq).view(1, 1, seq).expand(3, 1, seq)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        lm(inputs_embeds=embeds, position_ids=positions)
    _, shape = _shape("llm", seq)
    fl = module_flops(shape, seq)
    h, v = ARCH["llm"]["hidden_size"], ARCH["llm"]["vocab_size"]
    assert counter.get_total_flops() == pytest.approx(fl.matmul_fwd - 2 * seq * h * v, rel=1e-9)

    grid = torch.tensor([[1, 16, 16]])  # 256 patches: 4 windows of 64
    pixels = torch.randn(256, 3 * 2 * 14 * 14)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        hf_model.model.visual(pixels, grid_thw=grid)
    _model, shape = _shape("vision", 256)
    fl = module_flops(shape, 256)
    patch_embed = 2 * 256 * 3 * 2 * 14 * 14 * ARCH["vision"]["hidden_size"]  # Conv3d: not a planner matmul
    assert counter.get_total_flops() == pytest.approx(fl.matmul_fwd + patch_embed, rel=1e-9)


@pytest.mark.parametrize(
    ("family", "model"), [("qwen3_vl", "tiny_qwen3_vl"), ("qwen3_vl_moe", "tiny_qwen3_vl_moe")]
)
def test_qwen3_llm_with_per_head_norms_matches_saved_tensors(family: str, model: str) -> None:
    """Qwen3's attention normalizes q and k per head (``Attention.qk_norm``): their fp32 inputs, rsqrt
    and outputs are saved too (15 % of tiny Qwen3-VL's LLM activations when left out). The family's
    LLM module, one forward with the loss (AC off), against every saved term the planner counts."""
    import torch

    from dhp.metrics.accounting import saved_by_part
    from dhp.models.entries import model_entry
    from dhp.models.registry import get_family

    seq, fam, entry = 256, get_family(family), model_entry(model)
    torch.manual_seed(0)
    llm = fam.build_module("llm", fam.hf_config(entry), device="cpu", dtype=torch.float32)
    ids = torch.randint(20, 1000, (1, seq), generator=torch.Generator().manual_seed(0))
    saved, _ = saved_by_part(
        lambda: llm(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone(),
                    mm_token_type_ids=torch.zeros_like(ids)),
        {},
        exclude=list(llm.parameters()),
    )  # fmt: skip
    module = OmegaConf.merge(
        OmegaConf.structured(ModuleConfig),
        {"parallel": {"dp": 1}, "seq_len": seq, "mixed_precision": "fp32", "activation_checkpointing": "off"},
    )
    shape = module_shape(
        "llm", model=OmegaConf.structured(entry), module=module, layout=module_layout(module), micro_batch=1
    )
    assert shape.arch.blocks[0].attention.qk_norm
    assert sum(saved.values()) == pytest.approx(sum(activations_of(shape).values()), rel=TOLERANCE)


def _master_weights(shape):
    """``shape`` under ``bf16_master_fp32`` (fp32 master weights, bf16 compute)."""
    import dataclasses

    from dhp.plan.memory import precision

    return dataclasses.replace(shape, precision=precision("bf16_master_fp32"))


def test_master_weights_match_saved_tensors(hf_model) -> None:
    """``bf16_master_fp32`` at fsdp=1 (the runtime's unit cast, ``dhp.parallel.precision``): what autograd
    saves, the bf16 copies of the weights the ops keep included, against the planner's bf16
    activations plus ``compute_weights`` (the LLM's blocks here: ``language_model`` has no lm_head and
    its embedding is not called; the encoder's blocks, patch embedding and merger)."""
    import copy

    import torch

    from dhp.parallel.precision import apply_compute_cast
    from dhp.plan.memory import compute_copy_elems

    seq = 512
    lm = copy.deepcopy(hf_model.model.language_model)
    for unit in (*lm.layers, lm.norm):
        apply_compute_cast(unit, [], dtype=torch.bfloat16)
    embeds = torch.randn(1, seq, ARCH["llm"]["hidden_size"]).bfloat16().requires_grad_(True)
    positions = torch.arange(seq).view(1, 1, seq).expand(3, 1, seq)
    measured = _saved_bytes(lm, lambda: lm(inputs_embeds=embeds, position_ids=positions))
    shape = _master_weights(_shape("llm", seq)[1])
    detail = activations_of(shape)
    _, blocks, _ = compute_copy_elems(shape)
    assert detail["layers"] + detail["final_norm"] + 2 * blocks == pytest.approx(measured, rel=TOLERANCE)

    visual = copy.deepcopy(hf_model.model.visual)
    apply_compute_cast(visual, list(visual.blocks), dtype=torch.bfloat16)
    grid = torch.tensor([[1, 32, 32]])
    pixels = torch.randn(1024, 3 * 2 * 14 * 14)
    measured = _saved_bytes(visual, lambda: visual(pixels, grid_thw=grid))
    detail = activations_of(_master_weights(_shape("vision", 1024)[1]))
    assert detail["compute_weights"] > 0
    assert sum(detail.values()) == pytest.approx(measured, rel=TOLERANCE)
