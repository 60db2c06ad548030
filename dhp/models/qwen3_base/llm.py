"""The LLM module of every Qwen3-style family: transformers' own text model + ``lm_head``, the encoder's
edges placed, the LM loss and, in the MoE flavour, the router's load-balancing loss.

The cut is the one the family's ``...Model.forward`` makes internally: the encoder returns the merged
image tokens (and, with DeepStack, one merged feature per level), one row per image token in the same
order. :meth:`LLMModule.embed` scatters the image tokens into the input embeddings at the image-token
positions; the DeepStack features (:meth:`LLMModule.deepstack_list`) go to the text model, which adds
feature k at those positions after decoder layer k. M-RoPE positions come from transformers' own
``get_rope_index`` (:meth:`LLMModule.positions`). No state is kept between calls (no ``rope_deltas``, no
cache).

A packed micro-batch (``attention_mask`` holds each token's sample index, ``dhp.data.packing``): each
sample's positions are its own and the text model gets the masks that keep the samples apart, the
Gated DeltaNet layers of a hybrid decoder included (``dhp.models.packing``); the image rows and the
DeepStack features arrive in the packed row-major order, which is the order of the image tokens, and the
router sees the same tokens as unpacked (``attention_mask != 0``).

MoE flavour: the auxiliary loss is the one transformers' ``...ForConditionalGeneration.forward`` adds:
``router_aux_loss_coef * load_balancing_loss_func`` over every router's logits (recorded by transformers'
own ``output_router_logits``), padding excluded by the 2-D ``attention_mask``, added to the mean LM loss,
both over the batch of the call. dhp's batch is the STEP's (every micro-batch of every data replica),
so the term is ``coef * L(step)``, ``L`` over the step's unpadded tokens, like the LM loss's mean over the
step's label tokens ``T``, whatever the micro-batch cut or the data-parallel degree. :meth:`LLMModule.
router_loss` (its one home) puts each rank's and micro-batch's exact part of it into ``loss_sum`` in
token-sum units (``dhp.parallel.load_balancing``): with one micro-batch per step from the counts
all-reduced over ``aux_loss_group`` inside the forward; with several from the step's counts, which the
runtime gathers first (``batch_statistics=True``: a forward without gradient that returns the routing
sums, ``dhp.models.family.StepStatistics``) and hands to each micro-batch (``step_statistics``). So
``sum of loss_sum / T`` is transformers' ``loss`` on the step's batch in one call. Its unweighted value
(over the step, or over the micro-batch without ``step_statistics``) is returned beside
(``LLMOutput.aux_losses["router_aux_loss"]``, transformers' ``aux_loss``) for logging.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from dhp.errors import DataError
from dhp.models.common import LLMBase, TextCall, rope_index, sample_names
from dhp.models.family import LLMOutput, StepStatistics
from dhp.models.qwen3_vision.arch import deepstack_kwarg
from dhp.parallel.load_balancing import RouterStats, load_balancing_loss, router_share, router_stats

__all__ = ["ROUTER_AUX_LOSS", "LLMModule"]

#: the name of the (unweighted) load-balancing loss in ``LLMOutput.aux_losses`` and the metrics
ROUTER_AUX_LOSS = "router_aux_loss"


class LLMModule(LLMBase):
    """Token embeddings, the decoder layers (DeepStack additions inside, when the encoder has them),
    final norm and lm_head -> the summed LM loss (+ the weighted load-balancing loss when ``moe``).

    Placement: one actor group. Memory is dominated by model states, which is why ``dhp/parallel``
    shards this module by weights (TP/FSDP); in the MoE flavour by the routed experts (``3*E*I*H`` per
    sparse layer), which ``dhp/parallel`` shards by expert (EP, ``parallel_plan().moe_blocks``).
    ``config`` is the full VLM config; ``rope_model`` the transformers class whose ``get_rope_index``
    gives the positions; ``family`` names the family in messages.

    ``aux_loss_group`` (MoE): the process group whose ranks hold DIFFERENT tokens of the step's batch
    (the module's dp x fsdp x cp x sp ranks, never TP duplicates), set by ``dhp.parallel``; then the
    load-balancing loss is the group's (its per-expert counts are all-reduced). None (the default): this
    rank's tokens alone. A plain attribute, like ``loss_fn``.

    ``batch_terms`` (MoE with a non-zero ``router_aux_loss_coef``): ``("router_aux_loss",)``, the term
    defined on the step's batch (``dhp.models.family.StepStatistics``).
    """

    def __init__(
        self,
        language_model: nn.Module,
        lm_head: nn.Linear,
        config: PretrainedConfig,
        *,
        rope_model: type,
        moe: bool,
        num_deepstack: int,
        family: str,
    ) -> None:
        super().__init__(language_model, lm_head, config)
        self.moe = moe
        self.num_deepstack = num_deepstack  # K, the DeepStack features expected with the image embeddings
        self._rope_model = rope_model
        self._family = family
        self.aux_loss_group: dist.ProcessGroup | None = None  # a plain attribute, set by dhp.parallel

    @property
    def batch_terms(self) -> tuple[str, ...]:  # type: ignore[override]
        """The router's load-balancing loss, when the model adds one (MoE, coefficient != 0)."""
        coef = self.vl_config.text_config.router_aux_loss_coef if self.moe else 0.0
        return (ROUTER_AUX_LOSS,) if coef else ()

    def prepare(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        mm_token_type_ids: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        sample_ids: list[str] | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        batch_statistics: bool = False,
        step_statistics: StepStatistics | None = None,
        hidden_states: torch.Tensor | None = None,
        **deepstack_embeds: torch.Tensor,
    ) -> TextCall:
        """One micro-batch's text-model call (``forward`` = prepare, the text model, :meth:`finish`,
        which returns ``LLMOutput(loss_sum, num_tokens, aux_losses)``).

        ``image_embeds`` and ``deepstack_embeds_k`` (the vision module's outputs) are placed at the
        image-token positions: the first in the input embeddings, feature k added after decoder layer
        k. Make them leaves with ``requires_grad`` to receive the gradients for the encoder's backward.
        MoE: ``loss_sum`` includes the weighted load-balancing term (:meth:`router_loss`; over the step
        with ``step_statistics``), ``aux_losses`` its unweighted value. ``batch_statistics=True`` (MoE):
        no LM head and no loss; :meth:`finish` returns the micro-batch's routing sums over
        ``aux_loss_group`` (``RouterStats.values``, :meth:`route_statistics`; call it without gradient).
        ``hidden_states`` (a later pipeline stage): the previous stage's output replaces the input
        embeddings (no lookup, no image rows placed). Raises DataError when image tokens and embeddings
        disagree, when a DeepStack level is missing or extra, when ``mm_token_type_ids`` is missing with
        images (M-RoPE would silently become 1D), and for videos (``second_per_grid_ts``): these
        families declare no video capability.
        """
        sample_ids = sample_names(input_ids, sample_ids)
        if second_per_grid_ts is not None:
            raise DataError(
                f"samples {sample_ids}: hold videos, but the {self._family} family has no video path proven "
                f"against transformers (it declares video=False). Fix: drop the video records from the "
                f"dataset, or train them with a family that declares video (qwen2_5_vl)."
            )
        deepstack = self.deepstack_list(image_embeds, deepstack_embeds, sample_ids)
        inputs_embeds = hidden_states
        if hidden_states is None:
            inputs_embeds = self.embed(
                input_ids=input_ids,
                mm_token_type_ids=mm_token_type_ids,
                image_grid_thw=image_grid_thw,
                image_embeds=image_embeds,
                sample_ids=sample_ids,
            )
        position_ids, text_mask, extra = self.text_inputs(
            inputs_embeds=inputs_embeds,
            input_ids=input_ids,
            attention_mask=attention_mask,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
        )
        if deepstack is not None:  # added at the image tokens after the first K decoder layers
            visual_pos_masks = (self.cut(input_ids) == self.vl_config.image_token_id).to(inputs_embeds.device)
            extra.update(visual_pos_masks=visual_pos_masks, deepstack_visual_embeds=deepstack)
        if self.moe:
            extra["output_router_logits"] = True  # transformers' recorder: every router's [B*S, E] logits
        kwargs = dict(attention_mask=text_mask, position_ids=position_ids, use_cache=False, **extra)
        state = dict(batch_statistics=batch_statistics, step=step_statistics, attention_mask=attention_mask)
        return TextCall(inputs_embeds=inputs_embeds, kwargs=kwargs, labels=labels, state=state)

    def finish(self, out: Any, call: TextCall) -> LLMOutput | torch.Tensor:
        """The LM loss of the last hidden state, plus the MoE's load-balancing term (or, with
        ``batch_statistics``, the routing sums; :meth:`prepare`)."""
        attention_mask = call.state["attention_mask"]
        if call.state["batch_statistics"]:
            return self.route_statistics(out.router_logits, attention_mask=self.cut(attention_mask != 0))
        lm = self.loss(hidden=out.last_hidden_state, labels=call.labels)
        if not self.moe:
            return lm
        staged = getattr(self, "pipeline_stages", None) is not None  # the last stage: its own routers
        if staged and (not self.batch_terms or call.state["step"] is None):
            if self.batch_terms:
                raise DataError(
                    f"the {self._family} LLM's router load-balancing loss (router_aux_loss_coef != 0) "
                    "spans every stage's routers: under pipeline parallelism each stage takes its share "
                    "from the step's routing sums, which only the step-statistics pass gives. Fix: set "
                    "train.router_aux_loss=step, or model.llm.extra.router_aux_loss_coef=0."
                )
            return lm
        if staged and not out.router_logits:  # a last stage of dense layers adds no share
            return LLMOutput(loss_sum=lm.loss_sum, num_tokens=lm.num_tokens, aux_losses={
                ROUTER_AUX_LOSS: RouterStats.of_values(call.state["step"].values, device=lm.loss_sum.device).loss(
                    self.vl_config.text_config.num_experts)})  # fmt: skip
        # padding excluded: a packed row's sample ids (k >= 1) mark the same tokens as unpacked
        term, aux = self.router_loss(
            out.router_logits,
            attention_mask=self.cut(attention_mask != 0),
            num_tokens=lm.num_tokens,
            step=call.state["step"],
        )
        return LLMOutput(
            loss_sum=lm.loss_sum + term, num_tokens=lm.num_tokens, aux_losses={ROUTER_AUX_LOSS: aux}
        )

    def router_loss(
        self,
        router_logits: tuple[torch.Tensor, ...],
        *,
        attention_mask: torch.Tensor,
        num_tokens: int,
        step: StepStatistics | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weighted load-balancing term in ``loss_sum`` units, the unweighted loss, detached).

        ``L = E * sum_e (C_e / R) * (S_e / R)`` over a set of tokens: ``C`` the top-k counts, ``S`` the
        router probability sums, ``R`` the unpadded rows (tokens x MoE layers). With ``C`` and ``R`` of the
        set known, this rank's micro-batch holds the share ``s = E * sum_e (C_e / R) * s_e / R`` of ``L``
        (its own probability sums ``s_e``); the shares of the set sum to ``L``, their gradients to its.

        ``step`` given (several micro-batches per step): the set is the step's tokens, ``C`` and ``R`` the
        step's (``step.values``) and the term is ``coef * s * T`` (``T = step.num_label_tokens``), so with
        the runtime's ``sum loss_sum / T`` the step's loss is ``mean CE + coef * L(step)``. ``step`` None:
        the set is this micro-batch's tokens over ``aux_loss_group`` (counts all-reduced here) and the
        term is ``coef * s * N``, ``N`` the group's label tokens of the micro-batch: with one micro-batch
        per step ``N = T`` and this IS the step's loss; with several it is the per-micro-batch definition
        (``train.router_aux_loss=micro_batch``), each micro-batch's ``L`` weighted by its label tokens.
        Gradients flow through the router probabilities only (the counts are constants, as in
        transformers).
        """
        t = self.vl_config.text_config
        if step is not None:
            local = router_stats(
                router_logits,
                num_experts=t.num_experts,
                top_k=t.num_experts_per_tok,
                attention_mask=attention_mask,
            )
            total = RouterStats.of_values(step.values, device=local.probs.device)
            share = router_share(local, total, num_experts=t.num_experts)
            tokens = torch.tensor(float(step.num_label_tokens), device=share.device)
            return t.router_aux_loss_coef * share * tokens, total.loss(t.num_experts)
        share, total = load_balancing_loss(
            router_logits,
            num_experts=t.num_experts,
            top_k=t.num_experts_per_tok,
            group=self.aux_loss_group,
            attention_mask=attention_mask,
        )
        tokens = torch.tensor(float(num_tokens), device=share.device)
        if self.aux_loss_group is not None and dist.get_world_size(self.aux_loss_group) > 1:
            dist.all_reduce(tokens, op=dist.ReduceOp.SUM, group=self.aux_loss_group)
        return t.router_aux_loss_coef * share * tokens, total

    def stage_router_share(self, out: Any, call: TextCall) -> torch.Tensor | None:
        """A pipeline stage's weighted share of the router term over its own layers' routers, from the
        step's routing sums (``call.state["step"]``, every stage's layers summed), in ``loss_sum`` units;
        None for a dense model, without the term, or a stage without routers."""
        step = call.state["step"]
        if not self.moe or not self.batch_terms or step is None or not out.router_logits:
            return None
        term, _ = self.router_loss(
            out.router_logits,
            attention_mask=self.cut(call.state["attention_mask"] != 0),
            num_tokens=0,
            step=step,
        )
        return term

    def stage_route_statistics(self, out: Any, call: TextCall) -> torch.Tensor:
        """A pipeline stage's routing sums of one micro-batch over its own layers' routers (zeros for a
        stage without routers; the stages' sums add up to the whole model's)."""
        if not out.router_logits:
            mask = call.state["attention_mask"]
            return torch.zeros(2 * self.vl_config.text_config.num_experts + 1, device=mask.device)
        return self.route_statistics(
            out.router_logits, attention_mask=self.cut(call.state["attention_mask"] != 0)
        )

    def route_statistics(
        self, router_logits: tuple[torch.Tensor, ...], *, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """The micro-batch's routing sums over ``aux_loss_group`` (``RouterStats.values``: counts,
        probability sums, rows; 2E + 1 floats, the same on every rank of the group; a collective)."""
        if not self.moe:
            raise DataError(
                f"the {self._family} LLM has no router: it has no batch statistics (batch_terms is empty)."
            )
        t = self.vl_config.text_config
        local = router_stats(
            router_logits,
            num_experts=t.num_experts,
            top_k=t.num_experts_per_tok,
            attention_mask=attention_mask,
        )
        return local.all_reduced(self.aux_loss_group).values()

    def deepstack_list(
        self,
        image_embeds: torch.Tensor | None,
        deepstack_embeds: dict[str, torch.Tensor],
        sample_ids: list[str],
    ) -> list[torch.Tensor] | None:
        """``deepstack_embeds_0..K-1`` in level order; None without images or without DeepStack (K = 0).
        A level given as None is absent (the runtime passes every edge of a producer that sent nothing,
        a text-only micro-batch, as None). DataError on a mismatch."""
        deepstack_embeds = {k: v for k, v in deepstack_embeds.items() if v is not None}
        expected = [deepstack_kwarg(k) for k in range(self.num_deepstack)]
        if image_embeds is None:
            if deepstack_embeds:
                raise DataError(
                    f"samples {sample_ids}: DeepStack features {sorted(deepstack_embeds)} were given without "
                    f"image_embeds. Fix: pass all of the vision module's outputs together, or none."
                )
            return None
        if sorted(deepstack_embeds) != sorted(expected):
            raise DataError(
                f"samples {sample_ids}: the LLM expects DeepStack features {expected} with image_embeds "
                f"(vision_config.deepstack_visual_indexes has {self.num_deepstack} levels) but got "
                f"{sorted(deepstack_embeds)}. Fix: pass every output of the vision module as a keyword."
            )
        out = []
        for name in expected:
            feature = deepstack_embeds[name]
            if feature.shape != image_embeds.shape:
                raise DataError(
                    f"samples {sample_ids}: {name} has shape {tuple(feature.shape)} but image_embeds has "
                    f"{tuple(image_embeds.shape)}; each DeepStack level has one row per image token. Fix: "
                    f"send the same rows of every vision output."
                )
            out.append(feature)
        return out or None

    def positions(
        self,
        *,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        mm_token_type_ids: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
    ) -> torch.Tensor:
        """``(3, B, S)`` interleaved-M-RoPE positions computed by the family's model's own
        ``get_rope_index`` (``Qwen3VLModel``, ``Qwen3_5Model``, ...). A batch without images needs no
        ``mm_token_type_ids`` (all text: plain 1D positions in the 3 rows; ``common.rope_index``)."""
        return rope_index(
            self._rope_model,
            self.vl_config.vision_config,
            input_ids=input_ids,
            attention_mask=attention_mask,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
        )
