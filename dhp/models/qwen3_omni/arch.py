"""Qwen3-Omni's thinker without torch (``ARCH``): ``audio`` and ``vision`` feeding an MoE ``llm``.

- ``audio``: Qwen3-Omni's audio encoder (``model.audio``): three stride-2 Conv2d over each chunk of
  ``2 * n_window`` mel frames (``downsample_hidden_size`` channels), a Linear to the hidden size, a
  sinusoidal position table restarted in every chunk, ``depth`` pre-LN blocks whose attention stays in a
  window of ``n_window_infer // (2 * n_window)`` chunks of one audio (kind ``window``), an ungated GELU
  MLP, LayerNorm and a two-Linear projection to the LLM width. 100 mel frames make 13 output rows. No
  TP; its SP axis cuts whole attention windows and exchanges nothing (``audio.shard_audio``).
- ``vision``: the Qwen3-VL-style encoder with DeepStack (``dhp/models/qwen3_vision``; transformers keeps
  its DeepStack mergers in ``visual.merger_list``,
  each merger's Linears in ``mlp.0`` / ``mlp.2``): TP and Ulysses SP.
- ``llm``: the Qwen3 MoE decoder (``dhp/models/qwen3_base/decoder.py``) with TMRoPE
  (``model.llm.extra.position_id_per_seconds``) and the router's load-balancing loss; the thinker has
  no dense flavour.

``model.audio.extra``: ``n_window_infer`` (mel frames of one attention window), ``downsample_hidden_size``
(the convs' channels) and ``conv_chunksize`` (chunks per conv call: memory only). Counts follow
transformers' ``Qwen3OmniMoeAudioEncoder`` exactly (the parity test compares with the meta model).
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
from dhp.models.qwen3_base import arch as base
from dhp.models.qwen3_base.arch import Flavour
from dhp.models.qwen3_base.decoder import DecoderNumbers, Qwen3DecoderArch
from dhp.models.qwen3_vision.arch import MergerNames, vision_tp_sharded

#: where transformers' Qwen3-Omni encoder keeps its mergers' Linears (``mlp`` = Linear, GELU, Linear)
MERGERS = MergerNames(deepstack="merger_list", fc1="mlp.0", fc2="mlp.2")
AUDIO_EMBEDS = "audio_embeds"
EXAMPLE = "qwen3_omni_30b_a3b"
#: ``model.audio`` sizes that must be positive, and its ``extra`` keys
AUDIO_SIZES = ("depth", "hidden_size", "num_heads", "intermediate_size", "num_mel_bins", "n_window")
AUDIO_EXTRA = ("conv_chunksize", "downsample_hidden_size", "n_window_infer")
#: mel frames per output row, rounded down (100 frames -> 13 rows: 7.7), so row counts are upper bounds
AUDIO_MERGE = 7
ROWS_PER_CHUNK = 13

#: What this family's runtime does exactly: no packing; video (with and without its audio track) has a
#: parity test (tests/parity/test_split_qwen3_omni.py).
CAPABILITIES = Capabilities(
    packing=False,
    video=True,
    tp_sharded={
        "audio": (),
        "vision": vision_tp_sharded(deepstack=True, mergers=MERGERS),
        # the sparse layers' router (mlp.gate) and experts (mlp.experts) are not TP-sharded
        "llm": (
            "*.embed_tokens",
            "*.layers.*.self_attn.*_proj",
            "*.layers.*.mlp.gate_proj",
            "*.layers.*.mlp.up_proj",
            "*.layers.*.mlp.down_proj",
            "lm_head",
        ),
    },
)


def conv_out_width(num_mel_bins: int) -> int:
    """Frequency bins after the three stride-2 convs: ``(((mels + 1) // 2 + 1) // 2 + 1) // 2``."""
    return (((num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2


def audio_block_params(a: Any) -> ParamCount:
    """ONE encoder block: LayerNorm x2 (weight+bias), q/k/v/out h->h with bias, fc1 h->m and fc2 m->h
    with bias. Nothing is TP-sharded (the module has no TP)."""
    h, m = a.hidden_size, a.intermediate_size
    return ParamCount(tp_sharded=0, replicated=4 * h + 4 * h * h + 4 * h + 2 * h * m + m + h)


def audio_params(a: Any, *, out_hidden: int) -> ParamCount:
    """The encoder: conv2d1 (1 -> d, 3x3, bias), conv2d2 and conv2d3 (d -> d, 3x3, bias), conv_out
    (d * freq -> h, no bias), the blocks, ``ln_post``, ``proj1`` (h -> h) and ``proj2`` (h -> out), with
    biases. The sinusoidal position table is a buffer."""
    h, d = a.hidden_size, a.extra["downsample_hidden_size"]
    convs = (9 * d + d) + 2 * (9 * d * d + d)
    root = (
        convs + d * conv_out_width(a.num_mel_bins) * h + 2 * h + (h * h + h) + (h * out_hidden + out_hidden)
    )
    return ParamCount(tp_sharded=0, replicated=a.depth * audio_block_params(a).replicated + root)


def audio_arch(model: Any) -> ModuleArch:
    """The encoder as the planner reads it. Its blocks run on about ``frames / 7.7`` rows; the planner
    counts a module's blocks per input row, so per-frame block costs are an upper bound. ``head_macs``
    (per mel frame): the three convs (9 taps each, at 1/2, 1/4, 1/8 of the frames' time x frequency
    positions), conv_out and the projections (per output row)."""
    a, out = model.audio, model.llm.hidden_size
    h, d, mels = a.hidden_size, a.extra["downsample_hidden_size"], a.num_mel_bins
    chunk = 2 * a.n_window
    ratio = a.extra["n_window_infer"] // chunk
    attn = Attention(
        kind="window", heads=a.num_heads, kv_heads=a.num_heads, head_dim=h // a.num_heads,
        window=ROWS_PER_CHUNK * ratio,
    )  # fmt: skip
    freq = [(mels + 1) // 2, ((mels + 1) // 2 + 1) // 2, conv_out_width(mels)]
    convs = 9 * d * freq[0] / 2 + 9 * d * d * freq[1] / 4 + 9 * d * d * freq[2] / 8
    per_row = d * freq[2] * h + h * h + h * out
    return ModuleArch(
        hidden=h,
        blocks=uniform_blocks(
            a.depth, attn, Mlp(kind="dense", intermediate=a.intermediate_size, gated=False)
        ),
        params=audio_params(a, out_hidden=out),
        block_params=audio_block_params(a),
        largest_param=max(9 * d * d, d * freq[2] * h, h * a.intermediate_size, h * out, h * h),
        outputs=(AUDIO_EMBEDS,),
        handoff_width=out,
        out_width=out,
        input_row=mels,
        merge=AUDIO_MERGE,
        head_macs=convs + per_row / AUDIO_MERGE,
        sp_unit=ratio * chunk,  # mel frames of one attention window: the SP cut's unit
        tp_input_grads=4,  # q, k, v, fc1
        tensors_per_block=16,
        root_tensors=12,
    )


def audio_axes() -> ModuleAxes:
    """No TP; SP over whole attention windows (each rank encodes its windows alone, no collective:
    ``audio.shard_audio``), so SP divides nothing; dp and fsdp as any module."""
    return ModuleAxes(tp=False, sp=True, tp_sequence_parallel=False)


def _validate_audio(model: Any, issues: Issues) -> None:
    a = model.audio
    if not issues.check(
        a.depth > 0,
        "model.audio.depth",
        a.depth,
        "qwen3_omni has an audio encoder (depth > 0)",
        f"copy model.audio from conf/model/{EXAMPLE}.yaml",
    ):
        return
    issues.positive(a, "model.audio", list(AUDIO_SIZES))
    have = sorted(a.extra) if "extra" in a else []
    if not issues.check(
        have == sorted(AUDIO_EXTRA),
        "model.audio.extra",
        have,
        f"qwen3_omni needs exactly {list(AUDIO_EXTRA)} here",
        f"copy model.audio.extra from conf/model/{EXAMPLE}.yaml",
    ):
        return
    issues.positive(a.extra, "model.audio.extra", list(AUDIO_EXTRA))
    if a.num_heads > 0:
        issues.check(
            a.hidden_size % a.num_heads == 0 and a.hidden_size % 2 == 0,
            "model.audio.hidden_size",
            a.hidden_size,
            f"must be even and divisible by model.audio.num_heads={a.num_heads}",
            "pick a head count that divides the hidden size",
        )
    rows = 2 * a.n_window
    for _ in range(3):
        rows = (rows - 1) // 2 + 1
    issues.check(
        rows == ROWS_PER_CHUNK,
        "model.audio.n_window",
        a.n_window,
        f"transformers' encoder counts {ROWS_PER_CHUNK} rows per chunk of 2 * n_window frames (n_window "
        f"gives {rows})",
        "use the published 50",
    )
    issues.check(
        a.extra["n_window_infer"] >= 2 * a.n_window,
        "model.audio.extra.n_window_infer",
        a.extra["n_window_infer"],
        f"an attention window must hold at least one chunk of 2 * n_window = {2 * a.n_window} frames",
        "use the published 800",
    )
    issues.check(
        a.max_source_positions >= ROWS_PER_CHUNK,
        "model.audio.max_source_positions",
        a.max_source_positions,
        f"must be >= {ROWS_PER_CHUNK} (the position table covers one chunk's rows)",
        "use the published 1500",
    )


class Qwen3OmniArch(Qwen3DecoderArch):
    """:class:`dhp.models.arch.FamilyArch` of Qwen3-Omni's thinker: always the MoE flavour."""

    module_names: tuple[str, ...] = ("audio", "vision", "llm")  # producers first
    #: ``config.json`` model types of a checkpoint: the thinker's own, or the whole Omni model's
    model_types: tuple[str, ...] = ("qwen3_omni_moe_thinker", "qwen3_omni_moe")
    moe = Flavour("qwen3_omni_moe_thinker", example=EXAMPLE)
    dense = moe  # the thinker has no dense flavour: :meth:`flavour` always answers ``moe``
    display = "Qwen3-Omni"
    capabilities = CAPABILITIES
    deepstack = True
    llm_extra = (*Qwen3DecoderArch.llm_extra, "position_id_per_seconds")

    def flavour(self, model: Any) -> Flavour:
        return self.moe

    def validate(self, model: Any, issues: Issues) -> None:
        _validate_audio(model, issues)
        super().validate(model, issues)
        if "extra" in model.llm and "position_id_per_seconds" in model.llm.extra:
            value = model.llm.extra["position_id_per_seconds"]
            issues.check(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                "model.llm.extra.position_id_per_seconds",
                value,
                "must be a positive number (TMRoPE's temporal positions per second)",
                "use the published 13",
            )

    def llm_arch(self, n: DecoderNumbers) -> ModuleArch:
        """The Qwen3 MoE decoder, taking the audio rows beside the vision edges."""
        module = super().llm_arch(n)
        return dataclasses.replace(module, inputs=(AUDIO_EMBEDS, *module.inputs))

    def llm_axes(self, n: DecoderNumbers) -> ModuleAxes:
        """As the Qwen3 decoder's, without context parallelism (no parity test with the audio placement
        and TMRoPE; the LLM refuses a context shard)."""
        return base.decoder_axes(n, sequence_parallel=False, mlp=n.sparse_layers < n.layers)

    def architecture(self, model: Any) -> Architecture:
        inner = self.architecture_of(self.numbers(model))
        return Architecture(
            modules={"audio": audio_arch(model), **inner.modules}, capabilities=self.capabilities
        )

    def module_axes(self, name: str, model: Any) -> ModuleAxes:
        return audio_axes() if name == "audio" else self.axes_of(name, self.numbers(model))

    def axes_of(self, name: str, n: Any) -> ModuleAxes:
        return audio_axes() if name == "audio" else super().axes_of(name, n)


ARCH = Qwen3OmniArch()
