"""Qwen2.5-VL's architecture numbers without torch: validation, geometry, and parameter counts
split by how tensor parallelism shards them (``ARCH``, a :class:`dhp.models.arch.FamilyArch`).

The counts follow transformers' modeling code exactly (a unit test instantiates the real model on
the meta device and compares). ``tp_sharded`` parameters are divided by the TP degree (attention
and MLP projections, and for the LLM the vocab-parallel ``embed_tokens``/``lm_head``);
``replicated`` ones are held whole by every TP rank (norms, the patch embedding, the bias of
row-parallel projections). The merger's MLP is column- then row-parallel, as in
``dhp/parallel/vision_tp.py``.
"""

from __future__ import annotations

from omegaconf import DictConfig

from dhp.config.issues import Issues
from dhp.models.arch import Geometry, LayerShape, LLMGeometry, ModuleAxes, ParamCount, VisionGeometry


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
        hidden=h,
        mlp=vision.intermediate_size,
        kv_dim=h,
        heads=vision.num_heads,
        layers=vision.depth,
        tp_input_grads=3,  # fused qkv, gate, up
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


def _llm_geometry(llm: DictConfig) -> LLMGeometry:
    return LLMGeometry(
        hidden_size=llm.hidden_size,
        num_layers=llm.num_layers,
        num_heads=llm.num_heads,
        num_kv_heads=llm.num_kv_heads,
        head_dim=llm.hidden_size // llm.num_heads,
        intermediate_size=llm.intermediate_size,
        vocab_size=llm.vocab_size,
        tie_word_embeddings=bool(llm.tie_word_embeddings),
    )


def _vision_geometry(v: DictConfig) -> VisionGeometry:
    return VisionGeometry(
        depth=v.depth,
        hidden_size=v.hidden_size,
        num_heads=v.num_heads,
        intermediate_size=v.intermediate_size,
        patch_size=v.patch_size,
        spatial_merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        window_size=v.window_size,
        in_channels=v.in_channels,
        fullatt_block_indexes=tuple(v.fullatt_block_indexes),
    )


_VISION_SIZES = [
    "depth",
    "hidden_size",
    "num_heads",
    "intermediate_size",
    "patch_size",
    "spatial_merge_size",
    "temporal_patch_size",
    "window_size",
    "in_channels",
]


def _validate_vision_arch(v: DictConfig, issues: Issues) -> None:
    issues.positive(v, "model.vision", _VISION_SIZES)
    if v.num_heads > 0:
        issues.check(
            v.hidden_size % v.num_heads == 0,
            "model.vision.hidden_size",
            v.hidden_size,
            f"must be divisible by model.vision.num_heads={v.num_heads}",
            "pick a head count that divides the hidden size",
        )
    unit = v.patch_size * v.spatial_merge_size
    if unit > 0:
        issues.check(
            v.window_size % unit == 0,
            "model.vision.window_size",
            v.window_size,
            f"must be a multiple of patch_size*spatial_merge_size={unit}",
            f"use a multiple of {unit}",
        )
    bad = [i for i in v.fullatt_block_indexes if not 0 <= i < v.depth]
    issues.check(
        not bad,
        "model.vision.fullatt_block_indexes",
        list(v.fullatt_block_indexes),
        f"indexes {bad} outside [0, depth={v.depth})",
        "list block indexes smaller than model.vision.depth",
    )


def _validate_llm_arch(lm: DictConfig, issues: Issues) -> None:
    issues.positive(
        lm,
        "model.llm",
        ["hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"],
    )
    if lm.num_heads > 0 and lm.num_kv_heads > 0:
        ok_h = issues.check(
            lm.hidden_size % lm.num_heads == 0,
            "model.llm.hidden_size",
            lm.hidden_size,
            f"must be divisible by model.llm.num_heads={lm.num_heads}",
            "pick a head count that divides the hidden size",
        )
        issues.check(
            lm.num_heads % lm.num_kv_heads == 0,
            "model.llm.num_kv_heads",
            lm.num_kv_heads,
            f"must divide model.llm.num_heads={lm.num_heads} (grouped-query attention)",
            "pick a KV head count that divides the head count",
        )
        if ok_h:
            half = lm.hidden_size // lm.num_heads // 2
            issues.check(
                sum(lm.mrope_section) == half,
                "model.llm.mrope_section",
                list(lm.mrope_section),
                f"must sum to head_dim/2 = {half}",
                "use the published [16, 24, 24] for head_dim 128",
            )


class Qwen25VLArch:
    """:class:`dhp.models.arch.FamilyArch` of Qwen2.5-VL (it uses no ``extra`` keys)."""

    def validate(self, model: DictConfig, issues: Issues) -> None:
        _validate_vision_arch(model.vision, issues)
        _validate_llm_arch(model.llm, issues)
        for part in ("vision", "llm"):
            extra = dict(model[part].extra) if "extra" in model[part] else {}
            issues.check(
                not extra,
                f"model.{part}.extra",
                extra,
                "qwen2_5_vl has no family-specific numbers",
                f"remove model.{part}.extra",
            )

    def geometry(self, model: DictConfig) -> Geometry:
        return Geometry(
            vision=_vision_geometry(model.vision),
            llm=_llm_geometry(model.llm),
            handoff_width=model.llm.hidden_size,
        )

    def module_params(self, name: str, model: DictConfig) -> ParamCount:
        return module_params(name, model)

    def layer_params(self, name: str, model: DictConfig) -> ParamCount:
        return layer_params(name, model)

    def largest_param(self, name: str, model: DictConfig) -> int:
        return largest_param(name, model)

    def module_axes(self, name: str, model: DictConfig) -> ModuleAxes:
        """Encoder: TP (heads, merger width) and Ulysses SP (heads). LLM: TP with SP inside it."""
        if name == "vision":
            v = model.vision
            heads = {"model.vision.num_heads": v.num_heads}
            wide = {"model.vision.hidden_size*spatial_merge_size^2": v.hidden_size * v.spatial_merge_size**2}
            return ModuleAxes(
                tp=True, sp=True, tp_sequence_parallel=False, tp_divides=heads | wide, sp_divides=heads
            )
        lm = model.llm
        return ModuleAxes(
            tp=True,
            sp=False,
            tp_sequence_parallel=True,
            tp_divides={
                "model.llm.num_heads": lm.num_heads,
                "model.llm.num_kv_heads": lm.num_kv_heads,
                "model.llm.vocab_size": lm.vocab_size,
                "model.llm.intermediate_size": lm.intermediate_size,
            },
        )

    def layer_shape(self, name: str, model: DictConfig) -> LayerShape:
        return vision_layer(model.vision) if name == "vision" else llm_layer(model.llm)


ARCH = Qwen25VLArch()
