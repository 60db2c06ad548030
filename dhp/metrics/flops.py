"""Model FLOPs per step (PaLM appendix B formula), counting the encoder and the LLM.

Per token, training = 6 * N (matmul params) + 12 * L * H * S_attn (attention scores and values),
where S_attn is the attention span. Forward only (a frozen module) = a third of that.
The encoder's span is the window for window-attention blocks and the image for full-attention
blocks. Embedding tables do not count (lookups, not matmuls); lm_head does.
"""

from __future__ import annotations

from dhp.config.schema import LLMArch, VisionArch


def _train_factor(frozen: bool) -> float:
    return 2.0 / 6.0 if frozen else 1.0


def vision_flops_per_step(
    *, arch: VisionArch, llm_hidden: int, image_patches: list[int], frozen: bool
) -> float:
    """FLOPs of the vision encoder (incl. merger) for images of ``image_patches`` patches each."""
    h, i = arch.hidden_size, arch.intermediate_size
    per_block = 4 * h * h + 3 * h * i  # qkv + proj, gate/up/down
    merged = h * arch.spatial_merge_size**2
    merger = (merged * merged + merged * llm_hidden) / arch.spatial_merge_size**2  # per patch
    n = arch.depth * per_block + merger + arch.in_channels * arch.temporal_patch_size * arch.patch_size**2 * h
    window = (arch.window_size // arch.patch_size) ** 2
    full = len(arch.fullatt_block_indexes)
    total = 0.0
    for p in image_patches:
        span = full * p + (arch.depth - full) * min(window, p)
        total += p * (6.0 * n + 12.0 * h * span)
    return total * _train_factor(frozen)


def llm_flops_per_step(*, arch: LLMArch, seq_lens: list[int], frozen: bool) -> float:
    """FLOPs of the LLM for sequences of ``seq_lens`` tokens each (causal span counted as full S)."""
    h, i = arch.hidden_size, arch.intermediate_size
    head = h // arch.num_heads
    kv = arch.num_kv_heads * head
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i
    n = arch.num_layers * per_layer + h * arch.vocab_size  # + lm_head
    total = sum(s * (6.0 * n + 12.0 * arch.num_layers * h * s) for s in seq_lens)
    return total * _train_factor(frozen)
