"""Qwen3-VL parameter counts and layer geometry for the planner, split by how TP shards them.

Everything is computed from the transformers config (``family.hf_config(model_cfg)`` or a HF
directory's), following transformers' modeling code exactly; a unit test builds the real modules on
the meta device and compares every count. ``tp_sharded`` parameters are divided by the TP degree;
``replicated`` ones are held whole by every TP rank (norms, the patch embedding, the learned position
table, biases of row-parallel projections) -- the TP plan of :mod:`dhp.models.qwen3_vl.tp`.

Vision block: LayerNorm x2 (weight + bias), fused qkv h->3h (+bias, colwise), proj h->h (+bias,
rowwise), MLP linear_fc1 h->m (+bias, colwise), linear_fc2 m->h (+bias, rowwise). Merger: LayerNorm
over h (the main merger) or over 4h (each DeepStack merger, post-shuffle), linear_fc1 4h->4h (+bias,
colwise), GELU, linear_fc2 4h->out (+bias, rowwise). Patch embedding: Conv3d with bias.

LLM layer (Qwen3): RMSNorm x2, q h->heads*head_dim, k/v h->kv_heads*head_dim, o heads*head_dim->h
(no biases), q_norm/k_norm over head_dim, SwiGLU MLP gate/up h->m, down m->h (no biases).
Embeddings and lm_head are vocab-parallel under TP.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Qwen3VLConfig


@dataclass(frozen=True)
class Counts:
    """Parameters of one module or one block: those TP shards and those every TP rank replicates."""

    tp_sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated


@dataclass(frozen=True)
class Geometry:
    """Sizes that set one transformer block's activations and matmul FLOPs.

    ``q_dim`` is the width of the attention's query/output projection: ``heads * head_dim``, which is
    NOT ``hidden`` in the 32B (64 x 128 = 8192 vs 5120). ``kv_dim = kv_heads * head_dim``.
    """

    hidden: int
    mlp: int
    q_dim: int
    kv_dim: int
    heads: int
    head_dim: int
    layers: int


def _merger(h: int, merge: int, out: int, *, postshuffle: bool) -> Counts:
    wide = h * merge
    norm = 2 * (wide if postshuffle else h)
    return Counts(tp_sharded=wide * wide + wide + wide * out, replicated=norm + out)


def vision_block(cfg: Qwen3VLConfig) -> Counts:
    """One encoder block (an FSDP unit)."""
    v = cfg.vision_config
    h, m = v.hidden_size, v.intermediate_size
    return Counts(tp_sharded=3 * h * h + 3 * h + h * h + h * m + m + m * h, replicated=4 * h + h + h)


def llm_block(cfg: Qwen3VLConfig) -> Counts:
    """One decoder layer (an FSDP unit)."""
    t = cfg.text_config
    h, m, d = t.hidden_size, t.intermediate_size, t.head_dim
    q, kv = t.num_attention_heads * d, t.num_key_value_heads * d
    return Counts(tp_sharded=h * q + 2 * h * kv + q * h + 3 * h * m, replicated=2 * h + 2 * d)


def module_counts(name: str, cfg: Qwen3VLConfig) -> Counts:
    """Parameters of module ``name`` (``vision``: incl. patch/position embeddings, merger and DeepStack
    mergers; ``llm``: incl. embeddings, final norm and lm_head unless tied)."""
    if name == "vision":
        v = cfg.vision_config
        h, merge, out = v.hidden_size, v.spatial_merge_size**2, v.out_hidden_size
        patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * h + h
        block = vision_block(cfg)
        merger = _merger(h, merge, out, postshuffle=False)
        deep = _merger(h, merge, out, postshuffle=True)
        levels = len(v.deepstack_visual_indexes)
        return Counts(
            tp_sharded=v.depth * block.tp_sharded + merger.tp_sharded + levels * deep.tp_sharded,
            replicated=v.depth * block.replicated
            + patch
            + v.num_position_embeddings * h
            + merger.replicated
            + levels * deep.replicated,
        )
    t = cfg.text_config
    block = llm_block(cfg)
    embeddings = t.vocab_size * t.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return Counts(
        tp_sharded=t.num_hidden_layers * block.tp_sharded + embeddings,
        replicated=t.num_hidden_layers * block.replicated + t.hidden_size,
    )


def block_counts(name: str, cfg: Qwen3VLConfig) -> Counts:
    """Parameters of ONE transformer block of module ``name`` (all-gathered at once under FSDP)."""
    return vision_block(cfg) if name == "vision" else llm_block(cfg)


def largest_param(name: str, cfg: Qwen3VLConfig) -> int:
    """Elements of the module's largest single parameter tensor (before TP/FSDP sharding)."""
    if name == "vision":
        v = cfg.vision_config
        h, wide = v.hidden_size, v.hidden_size * v.spatial_merge_size**2
        patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * h
        table = v.num_position_embeddings * h
        return max(wide * wide, wide * v.out_hidden_size, 3 * h * h, h * v.intermediate_size, patch, table)
    t = cfg.text_config
    q = t.num_attention_heads * t.head_dim
    return max(t.vocab_size * t.hidden_size, t.hidden_size * t.intermediate_size, t.hidden_size * q)


def geometry(name: str, cfg: Qwen3VLConfig) -> Geometry:
    """Block geometry of module ``name``: the encoder (full attention in every block) or the decoder."""
    if name == "vision":
        v = cfg.vision_config
        d = v.hidden_size // v.num_heads
        return Geometry(
            hidden=v.hidden_size,
            mlp=v.intermediate_size,
            q_dim=v.hidden_size,
            kv_dim=v.hidden_size,
            heads=v.num_heads,
            head_dim=d,
            layers=v.depth,
        )
    t = cfg.text_config
    return Geometry(
        hidden=t.hidden_size,
        mlp=t.intermediate_size,
        q_dim=t.num_attention_heads * t.head_dim,
        kv_dim=t.num_key_value_heads * t.head_dim,
        heads=t.num_attention_heads,
        head_dim=t.head_dim,
        layers=t.num_hidden_layers,
    )


def handoff_bytes_per_token(cfg: Qwen3VLConfig, *, bytes_per_element: int) -> int:
    """Bytes vision -> llm per merged image token: ``(1 + K) * out_hidden`` elements (K DeepStack levels).

    The gradients coming back are the same size.
    """
    v = cfg.vision_config
    return (1 + len(v.deepstack_visual_indexes)) * v.out_hidden_size * bytes_per_element
