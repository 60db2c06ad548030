"""Pieces every family composes instead of copying: the LLM's loss and image scatter, M-RoPE
positions from transformers' own ``get_rope_index`` on a stand-in, checkpoint key maps, the
reference model, tied parameters, the transformers config of a Qwen-style VLM, a blank image, and
the rotary buffers' re-initialisation after a meta build.

Nothing here names a family: a family passes its transformers classes and its key prefixes.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dhp.errors import CheckpointError
from dhp.models.checks import check_image_alignment, check_text_only
from dhp.models.family import LLMOutput
from dhp.models.packing import packed_decoder_inputs
from dhp.ops.cross_entropy import IGNORE_INDEX
from dhp.ops.cross_entropy import shifted_ce_sum as _chunked_shifted_ce_sum
from dhp.ops.packed import is_packed

#: ``loss_fn(hidden (B, S, H), lm_head, labels (B, S) unshifted, *, shift=True) -> fp32 loss SUM``
#: (``shift=False``: ``labels`` are already each token's target)
LossFn = Callable[..., torch.Tensor]


def shifted_ce_sum(
    hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, *, shift: bool = True
) -> torch.Tensor:
    """The default ``loss_fn`` of an LLM module: fp32 SUM of next-token CEs, ``labels`` (B, S) unshifted.

    One process, the whole vocab, chunked over tokens (``dhp.ops.cross_entropy``, default chunk):
    equals transformers' ``ForCausalLMLoss`` with ``reduction="sum"``.
    """
    return _chunked_shifted_ce_sum(hidden, lm_head.weight, labels, bias=lm_head.bias, shift=shift)


def loss_output(
    loss_fn: LossFn, *, hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor
) -> LLMOutput:
    """``loss_fn(hidden, lm_head, labels)`` and the number of label tokens after the shift.

    The loss reads ``lm_head``'s weight itself, chunk by chunk, so full-sequence logits never exist;
    under TP/SP ``dhp.parallel`` swaps ``loss_fn`` for the vocab-parallel variant of the same op
    (``dhp.ops.cross_entropy``, INTERFACES.md).
    """
    loss_sum = loss_fn(hidden, lm_head, labels)
    num_tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
    return LLMOutput(loss_sum=loss_sum, num_tokens=num_tokens)


def scatter_rows(inputs_embeds: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``inputs_embeds`` (B, S, H) with ``rows`` (N, H) placed, in order, where ``mask`` (B, S) is true."""
    rows = rows.to(inputs_embeds.device, inputs_embeds.dtype)
    return inputs_embeds.masked_scatter(mask.unsqueeze(-1).to(inputs_embeds.device), rows)


@dataclass
class TextCall:
    """One micro-batch's call of the text model, split where a pipeline stage cuts it: what
    :meth:`LLMBase.prepare` computes before the decoder layers (the input embeddings, absent on a stage
    that receives its hidden states; positions, masks and the per-layer extras) and what
    :meth:`LLMBase.finish` needs after them (labels and the family's own state)."""

    inputs_embeds: torch.Tensor | None
    kwargs: dict[str, Any]  # the text model's keyword arguments besides inputs_embeds
    labels: torch.Tensor
    state: dict[str, Any]


class LLMBase(nn.Module):
    """What every family's LLM module shares: transformers' text model (``language_model``) and
    ``lm_head``, the encoder's rows placed at their tokens in the input embeddings (:meth:`embed`), and
    the summed loss (:meth:`loss`). ``config`` is the full VLM config (``vl_config``; None: a text-only
    LLM); a family's module adds its forward (positions, the text model's call, any edge beside the
    image rows).

    ``loss_fn`` is a plain attribute, not a submodule: ``dhp.parallel`` swaps it for the vocab-parallel
    loss under TP.

    ``context_shard`` (a plain attribute, None without context parallelism): ``dhp.parallel.cp`` sets it;
    then the family computes every position on the whole sequence and :meth:`cut` keeps this rank's
    tokens: :meth:`embed`, :meth:`text_mask` and :meth:`loss` already do their part.

    ``batch_terms``: the names of the loss terms defined on a batch rather than summed over tokens
    (``dhp.models.family.StepStatistics`` says what the runtime then does); none here.
    """

    batch_terms: tuple[str, ...] = ()

    def forward(self, *, pipeline_stage: Callable[[nn.Module], Any] | None = None, **inputs: Any) -> Any:
        """One micro-batch: :meth:`prepare`, the text model over every decoder layer, :meth:`finish`.

        ``pipeline_stage`` (``dhp.parallel.pipeline``): one stage's body, called with this module in
        place of that (it runs :meth:`prepare`, its layers and, on the last stage, :meth:`finish`), so
        that the hooks on this module (FSDP2's root unshard and resharding) run around every stage's
        forward as around a whole one."""
        if pipeline_stage is not None:
            return pipeline_stage(self)
        call = self.prepare(**inputs)
        out = self.language_model(input_ids=None, inputs_embeds=call.inputs_embeds, **call.kwargs)
        return self.finish(out, call)

    def prepare(self, *, hidden_states: torch.Tensor | None = None, **inputs: Any) -> TextCall:
        """The text model's call for one micro-batch (the family's batch keywords and edge inputs);
        ``hidden_states`` given (a later pipeline stage): they replace the input embeddings."""
        raise NotImplementedError

    def finish(self, out: Any, call: TextCall) -> Any:
        """The text model's output -> the micro-batch's ``LLMOutput`` (the family's loss)."""
        raise NotImplementedError

    def __init__(
        self, language_model: nn.Module, lm_head: nn.Linear, config: PretrainedConfig | None
    ) -> None:
        super().__init__()
        self.language_model = language_model
        self.lm_head = lm_head
        self.vl_config = config
        self.loss_fn: LossFn = shifted_ce_sum
        self.context_shard: Any = None  # dhp.parallel.cp.ContextShard under context parallelism

    def cut(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``x`` (a per-token tensor of the whole micro-batch, sequence along ``dim``) at this rank's
        tokens: itself without context parallelism."""
        return x if self.context_shard is None else self.context_shard.take(x, dim)

    def text_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The text model's ``attention_mask``: the 2-D mask as given, or under context parallelism the
        4-D mask of this rank's queries over every rank's keys (``ContextShard.text_mask``), built from
        the whole micro-batch's mask (sample ids: padding and packed samples)."""
        if self.context_shard is None or attention_mask is None:
            return attention_mask
        full = self.context_shard.text_mask(attention_mask)
        types = set(getattr(self.language_model.config, "layer_types", None) or ())
        if "linear_attention" not in types:
            return full
        # a hybrid decoder takes a mapping: its linear-attention layers run on the whole (gathered)
        # sequence (dhp.parallel.linear_attn_cp), so their padding mask is the whole micro-batch's
        return {"full_attention": full, "linear_attention": attention_mask}

    def text_inputs(
        self,
        *,
        inputs_embeds: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        mm_token_type_ids: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        **video: torch.Tensor | None,
    ) -> tuple[torch.Tensor, Any, dict[str, Any]]:
        """``(position_ids, attention_mask, extra kwargs)`` for the text model on one micro-batch: a packed
        one's per-sample positions and masks (``dhp.models.packing.packed_decoder_inputs``), else the
        family's :meth:`positions` on the whole sequence, cut to this rank's tokens, and
        :meth:`text_mask`. Needs the family's ``positions`` (M-RoPE from transformers)."""
        if is_packed(attention_mask):  # several samples per row
            return packed_decoder_inputs(
                self,
                inputs_embeds=inputs_embeds,
                input_ids=input_ids,
                attention_mask=attention_mask,
                mm_token_type_ids=mm_token_type_ids,
                image_grid_thw=image_grid_thw,
                **video,
            )
        whole = self.positions(
            input_ids=input_ids,
            attention_mask=attention_mask,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
            **video,
        )
        position_ids = self.cut(whole, dim=-1)  # context parallelism: this rank's tokens
        return position_ids, self.text_mask(attention_mask), {}

    def placed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``(B, S)`` mask of the tokens that take the encoder's rows, in order (the image tokens)."""
        return input_ids == self.vl_config.image_token_id

    def embed(
        self,
        *,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        image_embeds: torch.Tensor | None,
        sample_ids: list[str],
    ) -> torch.Tensor:
        """Token embeddings ``(B, S, H)`` with the image embeddings scattered at :meth:`placed` positions;
        DataError (``checks.check_image_alignment``) when the tokens and the rows disagree. A text-only
        config (``vl_config`` None) takes no images (DataError naming the samples)."""
        if self.vl_config is None:
            check_text_only(
                input_ids=input_ids,
                mm_token_type_ids=mm_token_type_ids,
                image_embeds=image_embeds,
                sample_ids=sample_ids,
            )
            return self.language_model.embed_tokens(self.cut(input_ids))
        rows_at = None  # context parallelism: the rows given are those of this rank's tokens
        if self.context_shard is not None:
            rows_at = torch.zeros_like(input_ids, dtype=torch.bool)
            rows_at[:, self.context_shard.index(input_ids.shape[1], input_ids.device)] = True
        check_image_alignment(
            input_ids=input_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
            image_embeds=image_embeds,
            config=self.vl_config,
            sample_ids=sample_ids,
            rows_at=rows_at,
        )
        ids = self.cut(input_ids)
        inputs_embeds = self.language_model.embed_tokens(ids)
        if image_embeds is None:
            return inputs_embeds
        return scatter_rows(inputs_embeds, self.placed(ids), image_embeds)

    def loss(self, *, hidden: torch.Tensor, labels: torch.Tensor) -> LLMOutput:
        """``loss_fn(hidden, lm_head, labels)`` and the label-token count (:func:`loss_output`); under
        context parallelism ``hidden`` is this rank's tokens' and the targets are shifted on the whole
        sequence, then cut (``ContextShard.aligned_labels``)."""
        if self.context_shard is None:
            return loss_output(self.loss_fn, hidden=hidden, lm_head=self.lm_head, labels=labels)
        targets = self.context_shard.aligned_labels(labels)
        loss_sum = self.loss_fn(hidden, self.lm_head, targets, shift=False)
        return LLMOutput(loss_sum=loss_sum, num_tokens=int((targets != IGNORE_INDEX).sum()))


def sample_names(input_ids: torch.Tensor, sample_ids: list[str] | None) -> list[str]:
    """The micro-batch's sample ids for messages (``batch[i]`` where none were given)."""
    return sample_ids if sample_ids is not None else [f"batch[{i}]" for i in range(input_ids.shape[0])]


def rope_index(
    model_class: Any,
    vision_config: Any,
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    **video: torch.Tensor | None,
) -> torch.Tensor:
    """``(3, B, S)`` M-RoPE positions from ``model_class.get_rope_index`` itself (no model state).

    The method reads only ``config.vision_config`` and ``get_vision_position_ids`` from ``self``, so
    it runs on a stand-in rather than on a full (vision + LLM) model object. Without
    ``mm_token_type_ids`` every token is text (plain 1D positions in the 3 rows); callers check that
    no image is present then. ``video``: the family's video keywords (grids, seconds per grid).
    """
    if mm_token_type_ids is None:
        mm_token_type_ids = torch.zeros_like(input_ids)
    stand_in = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=vision_config),
        get_vision_position_ids=functools.partial(model_class.get_vision_position_ids, None),
    )
    position_ids, _ = model_class.get_rope_index(
        stand_in,
        input_ids,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=image_grid_thw,
        attention_mask=attention_mask,
        **video,
    )
    return position_ids


@dataclass(frozen=True)
class KeyMap:
    """Checkpoint keys <-> module FQNs: ``(key_prefix, module, fqn_prefix)`` rules, first match wins."""

    family: str
    owners: tuple[tuple[str, str, str], ...]

    def owner(self, key: str) -> tuple[str, str] | None:
        """Checkpoint key -> ``(module_name, module_fqn)``; None if no module owns it."""
        for prefix, module, fqn_prefix in self.owners:
            if key.startswith(prefix):
                return module, fqn_prefix + key[len(prefix) :]
        return None

    def hf_key(self, module: str, fqn: str) -> str:
        """``(module_name, module_fqn)`` -> the checkpoint key (the inverse of :meth:`owner`)."""
        for prefix, owner, fqn_prefix in self.owners:
            if owner == module and fqn.startswith(fqn_prefix):
                return prefix + fqn[len(fqn_prefix) :]
        raise CheckpointError(f"{self.family}: no checkpoint key for {module}.{fqn}")

    def split(
        self, state_dict: Mapping[str, torch.Tensor], module_names: tuple[str, ...]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """A whole-model state dict -> ``{module: {fqn: tensor}}``; CheckpointError on a key no module owns."""
        out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in module_names}
        unowned = []
        for key, tensor in state_dict.items():
            owner = self.owner(key)
            if owner is None:
                unowned.append(key)
                continue
            out[owner[0]][owner[1]] = tensor
        if unowned:
            raise CheckpointError(f"keys that belong to no {self.family} module: {sorted(unowned)}")
        return out


@dataclass(frozen=True)
class ExpertFold:
    """A fused expert tensor that a checkpoint may store as one tensor per expert instead.

    ``<layer>.<fused>`` [E, ...] is, for experts ``j = 0 .. E-1`` stacked on a new dim 0, the tensors
    ``<layer>.<experts>.{j}.<part>`` of ``parts`` concatenated in that order on ``dim`` (a dim of the
    per-expert tensor). ``<layer>`` is any key prefix (the module's own or a release's). E.g. the SwiGLU
    experts as transformers 5 fuses them on load: ``mlp.experts.gate_up_proj`` [E, 2I, H] from
    ``mlp.experts.{j}.gate_proj.weight`` and ``...up_proj.weight`` [I, H], gate first, on dim 0.
    The loader (``dhp.models.loading``) reads a rank's experts of it and never the others.
    """

    fused: str
    experts: str
    parts: tuple[str, ...]
    dim: int = 0

    def unfold(self, fused: torch.Tensor, sizes: Sequence[int]) -> list[tuple[torch.Tensor, ...]]:
        """The inverse of the fold: expert ``j``'s parts of ``fused`` [E, ...] (in ``parts`` order), cut
        on ``dim`` into ``sizes``. Each part is a contiguous copy (a file may hold it apart), so the
        copies cost as much memory as ``fused`` again while it is alive."""
        if len(sizes) != len(self.parts) or sum(sizes) != fused.shape[1 + self.dim]:
            raise ValueError(
                f"{self.fused}: sizes {list(sizes)} do not cut dim {self.dim} ({fused.shape[1 + self.dim]}) "
                f"of each expert into {self.parts}"
            )
        return [
            tuple(p.clone(memory_format=torch.contiguous_format) for p in expert.split(list(sizes), self.dim))
            for expert in fused
        ]


#: the LLM module's tied pair (``lm_head`` shares ``embed_tokens``' weight when embeddings are tied)
TIED_LM_HEAD = {"lm_head.weight": "language_model.embed_tokens.weight"}


def lm_head(text_config: PretrainedConfig, *, device: torch.device | str, dtype: torch.dtype) -> nn.Linear:
    """The vocabulary head ``hidden -> vocab`` (no bias), transformers' init off the meta device."""
    head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False, dtype=dtype)
    if not str(device).startswith("meta"):
        nn.init.normal_(head.weight, std=text_config.initializer_range)
    return head


def tie_parameters(module: nn.Module, tied: Mapping[str, str]) -> None:
    """Make each ``fqn`` of ``tied`` share its source's parameter again (after building or ``to_empty``):
    one tensor, one gradient, one optimizer state (``{"lm_head.weight": "language_model.embed_tokens.weight"}``)."""
    for fqn, source in tied.items():
        owner, _, attr = fqn.rpartition(".")
        setattr(functools.reduce(getattr, owner.split("."), module), attr, _attribute(module, source))


def _attribute(module: nn.Module, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), module)


def reference_model(model_class: Any, hf_config: PretrainedConfig) -> nn.Module:
    """The untouched transformers model, randomly initialised on CPU in the config's dtype."""
    cfg = copy.deepcopy(hf_config)
    return model_class._from_config(cfg, dtype=cfg.dtype)


def init_rotary_buffers(family: str, name: str, module: nn.Module) -> None:
    """Recompute the rotary ``inv_freq`` buffers (non-persistent) as transformers' init does.

    After ``to_empty`` they hold garbage; forgetting this is the classic meta-init bug. Any other
    non-persistent buffer would be left unset, so it is an error here.
    """
    handled = set()
    with torch.no_grad():
        for path, sub in module.named_modules():
            if "RotaryEmbedding" not in type(sub).__name__:
                continue
            rope_fns = {  # the module's own rules (2D axial vision, default text) before the shared table
                **ROPE_INIT_FUNCTIONS,
                "axial": getattr(sub, "compute_axial_rope_parameters", None),
                "default": getattr(sub, "compute_default_rope_parameters", None),
            }
            value, _ = rope_fns[sub.rope_type](sub.config)
            for buf in ("inv_freq", "original_inv_freq"):
                getattr(sub, buf).copy_(value)
                handled.add(f"{path}.{buf}")
    persistent = set(module.state_dict())
    left = [n for n, _ in module.named_buffers() if n not in persistent and n not in handled]
    if left:
        raise CheckpointError(f"{name}: non-persistent buffers {left} have no initialiser in {family}")


def blank_image(vision_config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest valid image of a Qwen-style encoder (FSDP replicas without images): one merge unit
    of zero patches, ``(m*m, C*T*P*P)``, and its grid ``[[1, m, m]]``."""
    m = vision_config.spatial_merge_size
    width = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    return torch.zeros(m * m, width), torch.tensor([[1, m, m]])


def decoder_config(
    *,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    rms_norm_eps: float,
    max_position_embeddings: int,
    rope_theta: float,
    **rope: Any,
) -> dict[str, Any]:
    """transformers' ``text_config`` keywords of a Qwen decoder's numbers (``rope``: the rotary
    parameters beside ``rope_theta``, e.g. ``mrope_section``); a family adds its own keys."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=rms_norm_eps,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, **rope},
    )


def vl_config(
    config_class: type[PretrainedConfig],
    *,
    architecture: str,
    vision: Mapping[str, Any],
    text: Mapping[str, Any],
    tokens: Any,
    tied: bool,
    attn_implementation: str,
    dtype: torch.dtype,
) -> PretrainedConfig:
    """A Qwen-style VLM's transformers config: ``vision`` / ``text`` sub-config keywords, the special
    token ids (``tokens``: a ``SpecialTokens`` or a mapping of its fields), tied embeddings, the
    attention kernel and dtype. ``architecture`` is the class ``config.json`` names to load it."""
    ids = {k: _field(tokens, k) for k in _TOKEN_FIELDS}
    return config_class(
        architectures=[architecture],
        vision_config=dict(vision),
        text_config={**text, **{k: ids[k] for k in _TEXT_TOKENS}},
        **{k: ids[k] for k in _TOKEN_FIELDS if k not in _TEXT_TOKENS},
        tie_word_embeddings=tied,
        attn_implementation=attn_implementation,
        dtype=dtype,
    )


_TEXT_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")
_TOKEN_FIELDS: Sequence[str] = (
    *_TEXT_TOKENS,
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


def _field(tokens: Any, key: str) -> int:
    return tokens[key] if isinstance(tokens, Mapping) else getattr(tokens, key)
