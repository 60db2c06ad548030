"""The planner's LLM matmul FLOPs follow the q/o projections' real width (heads * head_dim), which
Qwen3-VL sets apart from the hidden size (the 32B: 64 heads x 128 = 8192 against hidden 5120).

Pinned against torch's FlopCounterMode on transformers' own Qwen3-VL text model (matmuls only: on
CPU the sdpa kernel registers no FLOPs, and ``language_model`` has no lm_head).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dhp.layout import module_layout
from dhp.models import get_family
from dhp.plan.memory import module_shape
from dhp.plan.timing import module_flops
from dhp.validation import load_config


def test_llm_matmul_flops_use_heads_times_head_dim() -> None:
    # q/o: 4 heads x 32 = 128 columns against hidden 64
    over = ["model.llm.extra.head_dim=32", "model.llm.extra.mrope_section=[4,6,6]"]
    over += [
        "modules.llm.parallel.tp=1",
        "modules.llm.parallel.sequence_parallel=false",
        "modules.llm.gpus=1",
        "placement=disaggregated",
    ]
    cfg = load_config("tiny_qwen3_vl", over)  # one LLM rank: the whole layer's FLOPs
    family = get_family(cfg.model.family)
    hf = family.hf_config(cfg.model)
    assert hf.text_config.num_attention_heads * hf.text_config.head_dim != hf.text_config.hidden_size
    lm = family.build_module("llm", hf, device="cpu", dtype=torch.float32).language_model
    seq = 64
    embeds = torch.randn(1, seq, hf.text_config.hidden_size)
    positions = torch.arange(seq).view(1, 1, seq).expand(3, 1, seq)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        lm(inputs_embeds=embeds, position_ids=positions)
    shape = module_shape(
        "llm", model=cfg.model, module=cfg.modules.llm, layout=module_layout(cfg.modules.llm), micro_batch=1
    )
    fl = module_flops(shape, seq)
    h, v = hf.text_config.hidden_size, hf.text_config.vocab_size
    assert counter.get_total_flops() == pytest.approx(fl.matmul_fwd - 2 * seq * h * v, rel=1e-9)


def test_handoff_counts_every_edge_of_a_row() -> None:
    """Qwen3-VL sends image_embeds plus one DeepStack feature per level: the planner's hand-off
    payload is (1 + levels) x hidden columns per merged token, not hidden alone."""
    from dhp.plan.memory import module_shape as shape_of
    from dhp.plan.params import architecture

    cfg = load_config("tiny_qwen3_vl", [])
    shape = shape_of(
        "vision",
        model=cfg.model,
        module=cfg.modules.vision,
        layout=module_layout(cfg.modules.vision),
        micro_batch=1,
    )
    levels = len(cfg.model.vision.extra.deepstack_visual_indexes)
    assert (
        shape.handoff_width
        == (1 + levels) * cfg.model.llm.hidden_size
        == architecture(cfg.model).modules["vision"].handoff_width
    )
