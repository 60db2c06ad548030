"""Qwen2.5-Omni's thinker without torch (``ARCH``): three modules, ``audio`` and ``vision`` feeding ``llm``.

- ``audio``: Qwen2.5-Omni's Whisper-style encoder (``model.audio``): two Conv1d (the second stride 2),
  a sinusoidal position table restarted in every chunk, ``depth`` pre-LN blocks whose attention never
  leaves a chunk of ``2 * n_window`` mel frames (``n_window`` rows after the conv: kind ``window``),
  an ungated GELU MLP, a stride-2 average pool, LayerNorm and a projection to the LLM width. Four mel
  frames make one output row (``merge = 4``). No TP; its SP axis cuts whole chunks and exchanges
  nothing (``audio.shard_audio``).
- ``vision``: the Qwen2.5-VL-style encoder (``dhp/models/qwen2_5_vision``) with three q/k/v Linears:
  TP and Ulysses SP (one all-to-all per projection in each full-attention block).
- ``llm``: the Qwen2.5 decoder (``dhp/models/qwen2_5_base``) with TMRoPE (``model.llm.extra``:
  ``mrope_section``, ``position_id_per_seconds``, ``seconds_per_chunk``): TP (with Megatron SP inside
  it) and pipeline stages.

Counts follow transformers' ``Qwen2_5OmniAudioEncoder`` exactly (a unit test compares with the meta
model).
"""

from __future__ import annotations

from omegaconf import DictConfig

from dhp.config.issues import Issues
from dhp.models.arch import (
    Architecture,
    Attention,
    Capabilities,
    Mlp,
    ModuleArch,
    ModuleAxes,
    ParamCount,
    uniform_blocks,
)
from dhp.models.qwen2_5_base.arch import LLM_TP_SHARDED, llm_arch, llm_axes, validate_llm_arch
from dhp.models.qwen2_5_vision.arch import (
    validate_vision_arch,
    vision_arch,
    vision_axes,
    vision_tp_sharded,
)

#: What this family's runtime does exactly: no packing; video (with and without its audio track) has a
#: parity test (tests/parity/test_split_qwen2_5_omni.py).
CAPABILITIES = Capabilities(
    packing=False,
    video=True,
    tp_sharded={"audio": (), "vision": vision_tp_sharded(fused_qkv=False), "llm": LLM_TP_SHARDED},
)

#: ``model.audio`` sizes that must be positive
AUDIO_SIZES = ("depth", "hidden_size", "num_heads", "intermediate_size", "num_mel_bins", "n_window")
#: ``model.llm.extra`` keys of the thinker: M-RoPE's split and TMRoPE's time axis
LLM_EXTRA = ("mrope_section", "position_id_per_seconds", "seconds_per_chunk")
EXAMPLE = "qwen2_5_omni_7b"
#: mel frames per output row: the stride-2 conv, then the stride-2 average pool
AUDIO_MERGE = 4


def audio_block_params(audio: DictConfig) -> ParamCount:
    """ONE encoder block: LayerNorm x2 (weight+bias), q/v/out h->h with bias, k h->h without, fc1 h->m
    and fc2 m->h with bias. Nothing is TP-sharded (the module has no TP)."""
    h, m = audio.hidden_size, audio.intermediate_size
    return ParamCount(tp_sharded=0, replicated=4 * h + 4 * h * h + 3 * h + 2 * h * m + m + h)


def audio_params(audio: DictConfig, *, out_hidden: int) -> ParamCount:
    """The encoder: conv1 (mels -> h, kernel 3, bias), conv2 (h -> h, kernel 3, bias), the blocks,
    ``audio_bos_eos_token`` (2 x out, an Embedding transformers builds and the thinker never reads),
    ``ln_post`` and ``proj`` (h -> out, bias). The sinusoidal position table is a buffer."""
    h = audio.hidden_size
    root = (
        (3 * audio.num_mel_bins * h + h)
        + (3 * h * h + h)
        + 2 * out_hidden
        + 2 * h
        + h * out_hidden
        + out_hidden
    )
    return ParamCount(tp_sharded=0, replicated=audio.depth * audio_block_params(audio).replicated + root)


def audio_arch(model: DictConfig) -> ModuleArch:
    """The encoder as the planner reads it. Its blocks run on ``frames / 2`` rows (after the stride-2
    conv); the planner counts a module's blocks per input row, so per-frame block costs here are an
    upper bound (2x); ``head_macs`` (per mel frame): conv1's other two taps, conv2 (3 h^2 per 2 frames)
    and the projection (per 4 frames)."""
    a, out = model.audio, model.llm.hidden_size
    h = a.hidden_size
    attn = Attention(
        kind="window", heads=a.num_heads, kv_heads=a.num_heads, head_dim=h // a.num_heads, window=a.n_window
    )
    mlp = Mlp(kind="dense", intermediate=a.intermediate_size, gated=False)
    return ModuleArch(
        hidden=h,
        blocks=uniform_blocks(a.depth, attn, mlp),
        params=audio_params(a, out_hidden=out),
        block_params=audio_block_params(a),
        largest_param=max(3 * h * h, h * a.intermediate_size, h * out, 3 * a.num_mel_bins * h),
        outputs=("audio_embeds",),
        handoff_width=out,
        out_width=out,
        input_row=a.num_mel_bins,
        merge=AUDIO_MERGE,
        head_macs=2.0 * a.num_mel_bins * h + 1.5 * h * h + h * out / AUDIO_MERGE,
        sp_unit=2 * a.n_window,  # mel frames of one attention chunk: the SP cut's unit
        tp_input_grads=4,  # q, k, v, fc1
        tensors_per_block=15,
        root_tensors=9,
    )


def audio_axes() -> ModuleAxes:
    """The audio encoder's axes: no TP; SP over whole attention chunks (each rank encodes its chunks
    alone, no collective: ``audio.shard_audio``), so SP divides nothing; dp and fsdp as any module."""
    return ModuleAxes(tp=False, sp=True, tp_sequence_parallel=False)


def omni_llm_axes(*, heads: int, kv_heads: int, vocab: int, mlp: int, layers: int, tied: bool) -> ModuleAxes:
    """The thinker's decoder axes: TP with Megatron SP inside it (the embeddings, audio and image rows
    placed, are cut by the decoder's input style, as in Qwen2.5-VL) and pipeline stages over its decoder
    layers (a later stage takes the previous stage's hidden states; positions are the micro-batch's).
    Context parallelism is not declared (the LLM refuses a context shard: its audio rows would need
    the per-rank placement Qwen2.5-VL's image rows have)."""
    return llm_axes(
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        mlp=mlp,
        layers=layers,
        tied=tied,
        sequence_parallel=True,
        context_parallel=False,
        pipeline=True,
    )


def _validate_audio_arch(a: DictConfig, issues: Issues) -> None:
    issues.positive(a, "model.audio", list(AUDIO_SIZES))
    if a.num_heads > 0:
        issues.check(
            a.hidden_size % a.num_heads == 0 and (a.hidden_size // a.num_heads) % 2 == 0,
            "model.audio.hidden_size",
            a.hidden_size,
            f"must be divisible by model.audio.num_heads={a.num_heads}, and hidden_size even",
            "pick a head count that divides the hidden size",
        )
    issues.check(
        a.max_source_positions >= a.n_window,
        "model.audio.max_source_positions",
        a.max_source_positions,
        f"must be >= model.audio.n_window={a.n_window} (the position table covers one chunk's rows)",
        "use the published 1500",
    )
    have = sorted(a.extra) if "extra" in a else []
    issues.check(
        not have,
        "model.audio.extra",
        have,
        "qwen2_5_omni reads no extra audio numbers",
        "remove model.audio.extra",
    )


class Qwen25OmniArch:
    """:class:`dhp.models.arch.FamilyArch` of Qwen2.5-Omni's thinker (``model.audio``, ``model.vision``,
    ``model.llm``)."""

    module_names: tuple[str, ...] = ("audio", "vision", "llm")  # producers first
    #: ``config.json`` model types of a checkpoint: the thinker's own, or the whole Omni model's
    model_types: tuple[str, ...] = ("qwen2_5_omni_thinker", "qwen2_5_omni")

    def validate(self, model: DictConfig, issues: Issues) -> None:
        if issues.check(
            model.audio.depth > 0,
            "model.audio.depth",
            model.audio.depth,
            "qwen2_5_omni has an audio encoder (depth > 0)",
            f"copy model.audio from conf/model/{EXAMPLE}.yaml",
        ):
            _validate_audio_arch(model.audio, issues)
        validate_vision_arch(model.vision, issues, family="qwen2_5_omni", example=EXAMPLE)
        have = sorted(model.llm.extra) if "extra" in model.llm else []
        issues.check(
            have == sorted(LLM_EXTRA),
            "model.llm.extra",
            have,
            f"qwen2_5_omni needs exactly {list(LLM_EXTRA)} here (M-RoPE split and TMRoPE time axis)",
            f"copy model.llm.extra from conf/model/{EXAMPLE}.yaml",
        )
        validate_llm_arch(model.llm, issues)

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def architecture(self, model: DictConfig) -> Architecture:
        return Architecture(
            modules={
                "audio": audio_arch(model),
                "vision": vision_arch(model, fused_qkv=False),
                "llm": llm_arch(model, inputs=("audio_embeds", "image_embeds")),
            },
            capabilities=CAPABILITIES,
        )

    def module_axes(self, name: str, model: DictConfig) -> ModuleAxes:
        """Audio: SP over chunks, no TP. Vision: TP (heads, merger width) and Ulysses SP. LLM: TP."""
        if name == "audio":
            return audio_axes()
        if name == "vision":
            v = model.vision
            return vision_axes(heads=v.num_heads, hidden=v.hidden_size, merge=v.spatial_merge_size)
        lm = model.llm
        return omni_llm_axes(
            heads=lm.num_heads,
            kv_heads=lm.num_kv_heads,
            vocab=lm.vocab_size,
            mlp=lm.intermediate_size,
            layers=lm.num_layers,
            tied=bool(lm.tie_word_embeddings),
        )


ARCH = Qwen25OmniArch()
