"""Parameter counts of the Qwen2.5-VL modules, split by how tensor parallelism shards them.

The counts follow transformers' modeling code exactly (a unit test instantiates the real model on
the meta device and compares). ``tp_sharded`` parameters are divided by the TP degree (attention
and MLP projections, and for the LLM the vocab-parallel ``embed_tokens``/``lm_head``);
``replicated`` ones are held whole by every TP rank (norms, the patch embedding, the bias of
row-parallel projections). The merger's MLP is column- then row-parallel, as in
``dhp/parallel/vision_tp.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameters of one module: those TP shards and those every TP rank replicates."""

    tp_sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated

    def per_tp_rank(self, tp: int) -> float:
        return self.tp_sharded / tp + self.replicated


@dataclass(frozen=True)
class LayerShape:
    """Sizes that set one transformer layer's activations: hidden, MLP, KV width, heads."""

    hidden: int
    mlp: int
    kv_dim: int  # num_kv_heads * head_dim (== hidden without GQA)
    heads: int
    layers: int


def vision_params(vision: DictConfig, *, out_hidden: int) -> ParamCount:
    """Vision encoder incl. patch embedding and merger (``Qwen2_5_VisionTransformerPretrainedModel``).

    Block: RMSNorm x2 (h each), qkv Linear h->3h (+bias), proj h->h (+bias), SwiGLU MLP with
    bias (gate/up h->m, down m->h). Merger: RMSNorm(h), Linear 4h->4h (+bias), GELU,
    Linear 4h->out (+bias). Patch embedding: Conv3d without bias, C*T*P*P -> h.
    """
    h, m = vision.hidden_size, vision.intermediate_size
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2 * h
    block_sharded = 3 * h * h + 3 * h + h * h + 2 * (h * m + m) + m * h
    block_replicated = 2 * h + h + h  # norm1, norm2, bias of proj and down (row-parallel)
    merge_h = h * vision.spatial_merge_size**2
    merger_sharded = merge_h * merge_h + merge_h + merge_h * out_hidden  # mlp.0 column-, mlp.2 row-parallel
    merger_replicated = h + out_hidden  # ln_q, bias of mlp.2
    return ParamCount(
        tp_sharded=vision.depth * block_sharded + merger_sharded,
        replicated=vision.depth * block_replicated + patch + merger_replicated,
    )


def llm_params(llm: DictConfig) -> ParamCount:
    """Language model incl. embeddings, final norm and lm_head (unless tied).

    Layer: RMSNorm x2, q h->h (+bias), k/v h->kv (+bias), o h->h (no bias), MLP gate/up h->m,
    down m->h (no bias). Embeddings and lm_head are vocab-parallel under TP.
    """
    h, m, v = llm.hidden_size, llm.intermediate_size, llm.vocab_size
    kv = llm.num_kv_heads * (h // llm.num_heads)
    layer_sharded = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * m
    layer_replicated = 2 * h
    embeddings = v * h * (1 if llm.tie_word_embeddings else 2)
    return ParamCount(
        tp_sharded=llm.num_layers * layer_sharded + embeddings,
        replicated=llm.num_layers * layer_replicated + h,
    )


def vision_layer(vision: DictConfig) -> LayerShape:
    h = vision.hidden_size
    return LayerShape(
        hidden=h, mlp=vision.intermediate_size, kv_dim=h, heads=vision.num_heads, layers=vision.depth
    )


def llm_layer(llm: DictConfig) -> LayerShape:
    h = llm.hidden_size
    return LayerShape(
        hidden=h,
        mlp=llm.intermediate_size,
        kv_dim=llm.num_kv_heads * (h // llm.num_heads),
        heads=llm.num_heads,
        layers=llm.num_layers,
    )


def module_params(name: str, model: DictConfig) -> ParamCount:
    """Parameter count of module ``name`` (``vision`` or ``llm``) of ``model``."""
    if name == "vision":
        return vision_params(model.vision, out_hidden=model.llm.hidden_size)
    return llm_params(model.llm)


def layer_params(name: str, model: DictConfig) -> ParamCount:
    """Parameters of ONE transformer block of module ``name`` (an FSDP unit: all-gathered at once)."""
    if name == "vision":
        v = model.vision
        h, m = v.hidden_size, v.intermediate_size
        return ParamCount(tp_sharded=3 * h * h + 3 * h + h * h + 2 * (h * m + m) + m * h, replicated=4 * h)
    lm = model.llm
    h, m = lm.hidden_size, lm.intermediate_size
    kv = lm.num_kv_heads * (h // lm.num_heads)
    return ParamCount(tp_sharded=(h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * m, replicated=2 * h)


def largest_param(name: str, model: DictConfig) -> int:
    """Elements of the module's largest single parameter tensor (before TP/FSDP sharding)."""
    if name == "vision":
        v = model.vision
        h, merge_h = v.hidden_size, v.hidden_size * v.spatial_merge_size**2
        return max(merge_h * merge_h, merge_h * model.llm.hidden_size, 3 * h * h, h * v.intermediate_size)
    lm = model.llm
    return max(lm.vocab_size * lm.hidden_size, lm.hidden_size * lm.intermediate_size)
