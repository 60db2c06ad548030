"""Qwen2.5-VL's architecture numbers without torch: validation, geometry, and parameter counts
split by how tensor parallelism shards them (``ARCH``, a :class:`dhp.models.arch.FamilyArch`).

The encoder's numbers are the shared Qwen2.5-VL-style encoder's (``dhp/models/qwen2_5_vision/arch.py``),
the decoder's the shared Qwen2.5 decoder's (``dhp/models/qwen2_5_base/arch.py``).
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
from dhp.models.arch import (
    Architecture,
    Capabilities,
    ModuleArch,
    ModuleAxes,
    ParamCount,
)
from dhp.models.qwen2_5_base.arch import (
    LLM_TP_SHARDED,
    llm_axes,  # re-exported: this family's decoder axes
    llm_block_params,
    llm_largest_param,
    llm_params,
    validate_llm_arch,
)
from dhp.models.qwen2_5_base.arch import llm_arch as llm_arch_of
from dhp.models.qwen2_5_vision.arch import (
    validate_vision_arch,
    vision_arch,
    vision_axes,  # re-exported: this family's encoder axes
    vision_block_params,
    vision_largest_param,
    vision_params,
    vision_tp_sharded,
)

#: What this family's runtime does exactly (packing and video have parity tests).
CAPABILITIES = Capabilities(
    packing=True,
    video=True,
    tp_sharded={
        "vision": vision_tp_sharded(fused_qkv=True),
        "llm": LLM_TP_SHARDED,
    },
)


def module_params(name: str, model: DictConfig) -> ParamCount:
    """Parameter count of module ``name`` (``vision`` or ``llm``) of ``model``."""
    if name == "vision":
        return vision_params(model.vision, out_hidden=model.llm.hidden_size)
    return llm_params(model.llm)


def layer_params(name: str, model: DictConfig) -> ParamCount:
    """Parameters of ONE transformer block of module ``name`` (an FSDP unit: all-gathered at once)."""
    if name == "vision":
        return vision_block_params(model.vision)
    return llm_block_params(model.llm)


def largest_param(name: str, model: DictConfig) -> int:
    """Elements of the module's largest single parameter tensor (before TP/FSDP sharding)."""
    if name == "vision":
        return vision_largest_param(model.vision, out_hidden=model.llm.hidden_size)
    return llm_largest_param(model.llm)


LLM_EXTRA = ("mrope_section",)


def llm_arch(model: DictConfig) -> ModuleArch:
    """The decoder (``dhp.models.qwen2_5_base.arch.llm_arch``), fed the encoder's ``image_embeds``."""
    return llm_arch_of(model, inputs=("image_embeds",))


class Qwen25VLArch:
    """:class:`dhp.models.arch.FamilyArch` of Qwen2.5-VL (``vision.extra``: its window geometry)."""

    module_names: tuple[str, ...] = ("vision", "llm")  # producers first

    def validate(self, model: DictConfig, issues: Issues) -> None:
        validate_vision_arch(model.vision, issues, family="qwen2_5_vl", example="qwen_vl_7b")
        have = sorted(model.llm.extra) if "extra" in model.llm else []
        issues.check(
            have == sorted(LLM_EXTRA),
            "model.llm.extra",
            have,
            f"qwen2_5_vl needs exactly {list(LLM_EXTRA)} here (its M-RoPE split)",
            "copy model.llm.extra from conf/model/qwen_vl_7b.yaml",
        )
        validate_llm_arch(model.llm, issues)

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def architecture(self, model: DictConfig) -> Architecture:
        return Architecture(
            modules={"vision": vision_arch(model), "llm": llm_arch(model)}, capabilities=CAPABILITIES
        )

    def module_axes(self, name: str, model: DictConfig) -> ModuleAxes:
        """Encoder: TP (heads, merger width) and Ulysses SP (heads). LLM: TP with SP inside it."""
        if name == "vision":
            v = model.vision
            return vision_axes(heads=v.num_heads, hidden=v.hidden_size, merge=v.spatial_merge_size)
        lm = model.llm
        return llm_axes(
            heads=lm.num_heads,
            kv_heads=lm.num_kv_heads,
            vocab=lm.vocab_size,
            mlp=lm.intermediate_size,
            layers=lm.num_layers,
            tied=bool(lm.tie_word_embeddings),
        )


ARCH = Qwen25VLArch()
