"""``dhp verify``: run a plan and the unsplit transformers model side by side and compare every step.

The plan runs through the real runtime (:class:`dhp.runtime.Trainer`, Ray actor groups, hand-offs)
with ``collect_grads=True``; the reference is the family's untouched transformers model
(``family.reference_model``, its ``...ForConditionalGeneration``) in THIS (driver) process, started from
the plan's own initial weights, called as transformers calls it: the step's whole batch (every sample
of every data replica's micro-batches, right-padded to one tensor, packed rows unpacked into their
samples) in ONE forward with ``labels``, and, for a model with a router, ``output_router_logits=True``,
so its own ``loss`` is the mean LM loss plus ``router_aux_loss_coef * load_balancing_loss_func`` over the
whole batch. Nothing of the plan's loss code is shared. It is clipped by the same global norm and
stepped by the same AdamW and LR schedule. Each step compares the loss, the global grad norm, every
parameter's gradient (before clipping) and every parameter after the update (so a wrong clip
coefficient, LR group or optimizer shard shows even where grads agree). The report names the
reference's definition; where the plan's definition differs from it by choice
(``train.router_aux_loss=micro_batch`` with several micro-batches per replica), the report says so and
fails. The reference's update applies the PLAN's gradients of that step (already compared with its
own), so the parameter check sees the update path alone: AdamW normalises each element by its own
history, which turns a rounding-level difference in a near-zero gradient into up to ~lr per element
(LoRA's A matrices after a zero B are the common case); comparing updates of different gradients
would flag that rounding, and loosening the tolerance to ~lr would hide a wrong LR. Memory: the driver
holds one full fp32 copy of the model, its grads and Adam states, the activations and logits of the
step's whole batch, plus one full gradient copy of the plan: tiny and small models only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich import box
from rich.markup import escape
from rich.table import Table

from dhp.config.schema import ModelConfig, ModuleConfig, RunConfig, TrainConfig
from dhp.data import build_run_loader
from dhp.data.audio_sample import reference_audio_kwargs
from dhp.data.batch import VLBatch, concat_batches
from dhp.data.packing import unpacked
from dhp.data.remote import as_tensor
from dhp.data.video import reference_visual_kwargs
from dhp.errors import ConfigError, ConfigIssue, DataError
from dhp.layout import ParallelLayout
from dhp.models import get_family
from dhp.parallel.lora import inject_reference_lora
from dhp.parallel.param_groups import set_lr
from dhp.plan import compile_plan
from dhp.runtime.loop.driver import Trainer
from dhp.runtime.loop.schedule import make_schedule
from dhp.runtime.verify.reference_trainable import reference_optimizer

CLIP_EPS = 1e-6  # clip coefficient = grad_clip / (norm + CLIP_EPS), as torch's clip_grad_norm_


@dataclass
class StepDiff:
    """One step: plan vs reference loss and grad norm, the max |grad diff| per module, and the max
    |parameter diff| per module after the update (empty: not compared)."""

    step: int
    loss: float
    ref_loss: float
    grad_norm: float
    ref_grad_norm: float
    grad_max_abs_diff: dict[str, float]
    worst_param: dict[str, str]
    param_max_abs_diff: dict[str, float] = field(default_factory=dict)
    worst_param_after: dict[str, str] = field(default_factory=dict)

    @property
    def loss_rel_diff(self) -> float:
        return abs(self.loss - self.ref_loss) / max(abs(self.ref_loss), 1e-12)

    @property
    def grad_norm_rel_diff(self) -> float:
        return abs(self.grad_norm - self.ref_grad_norm) / max(abs(self.ref_grad_norm), 1e-12)


@dataclass
class VerifyReport:
    """All steps, the tolerances applied, and whether every step is within them. The grad norm is
    held to ``loss_rtol`` (relative), the parameters after each update to ``param_atol``."""

    steps: list[StepDiff] = field(default_factory=list)
    loss_rtol: float = 1e-5
    grad_atol: float = 1e-4
    param_atol: float = 1e-4
    plan_summary: str = ""
    reference: str = ""  # the reference's definition (ReferenceModel.definition)
    # why the plan's definition differs from the reference's by choice (empty: it does not); fails
    definition_differs: str = ""

    def step_ok(self, s: StepDiff) -> bool:
        diffs = [*s.grad_max_abs_diff.values(), *s.param_max_abs_diff.values()]
        finite = math.isfinite(s.loss) and math.isfinite(s.grad_norm) and all(map(math.isfinite, diffs))
        return (
            finite
            and s.loss_rel_diff <= self.loss_rtol
            and s.grad_norm_rel_diff <= self.loss_rtol
            and all(v <= self.grad_atol for v in s.grad_max_abs_diff.values())
            and all(v <= self.param_atol for v in s.param_max_abs_diff.values())
        )

    @property
    def passed(self) -> bool:
        same = not self.definition_differs
        return same and bool(self.steps) and all(self.step_ok(s) for s in self.steps)


class ReferenceModel:
    """The unsplit transformers model + AdamW + global-norm clip, run in this process.

    ``initial`` = ``{module: {module_fqn: tensor}}`` (e.g. ``trainer.full_state_dict()``); parameters of
    frozen modules get ``requires_grad=False`` and no optimizer state, as in the plan.
    """

    def __init__(
        self,
        *,
        model: ModelConfig,
        modules: dict[str, ModuleConfig],
        train: TrainConfig,
        initial: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        self.family = get_family(model.family)
        hf_config = self.family.hf_config(model)
        self.model = self.family.reference_model(hf_config)
        self.router_coef = _router_coef(hf_config)  # the load-balancing term's weight; None: no router
        self.pad_token_id = model.tokens.pad_token_id
        self.owner = self._owners()
        inject_reference_lora(self.model, self.owner, modules=modules)  # the plan's LoRA, by HF FQN
        self._load(initial, hf_config)
        # freeze / freeze_patterns / LoRA -> requires_grad; AdamW with the plan's param groups
        self.optimizer = reference_optimizer(self.model, self.owner, modules=modules, train=train)
        self.grad_clip = train.grad_clip

    def definition(self, data) -> str:
        """One line: what the reference computes on ``data`` (StepData), e.g. ``Qwen3VLMoeFor...Generation
        on the step's 4 samples in one call; loss = mean CE + 0.001 * load_balancing_loss_func``."""
        rows = [b for mb in data.micro_batches for b in mb]
        samples = sum(len(unpacked(b)) for b in rows)
        loss = (
            "mean CE"
            if self.router_coef is None
            else f"mean CE + {self.router_coef:g} * load_balancing_loss_func"
        )
        packed = sum(b.input_ids.shape[0] for b in rows) != samples
        note = " (packed rows unpacked into their samples)" if packed else ""
        return (
            f"{type(self.model).__name__} on the step's {samples} samples{note} in one call; loss = {loss} "
            "(transformers' own)"
        )

    def _owners(self) -> dict[str, tuple[str, str]]:
        """HF state-dict key -> (module, module FQN), via the family's own split."""
        out = {}
        for key, t in self.model.state_dict().items():
            for module, sub in self.family.split_state_dict({key: t}).items():
                for fqn in sub:
                    out[key] = (module, fqn)
        return out

    def params(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{module: {module FQN: parameter}}`` now (detached; a tied alias the plan does not hold
        as a tensor of its own is left out), comparable with ``Trainer.full_state_dict()``."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for key, p in self.model.named_parameters(remove_duplicate=False):
            module, fqn = self.owner[key]
            if (module, fqn) not in self.tied:
                out.setdefault(module, {})[fqn] = p.detach()
        return out

    def _load(self, initial: dict[str, dict[str, torch.Tensor]], hf_config) -> None:
        """Copy the plan's initial tensors in; tied parameters follow their source."""
        tied = {(m, f) for m in initial for f in self.family.tied_parameters(m, hf_config)}
        self.tied = {t for t in tied if t[1] not in initial[t[0]]}
        sd, absent = {}, []
        for key, (module, fqn) in self.owner.items():
            if module in initial and fqn in initial[module]:
                sd[key] = initial[module][fqn]
            elif (module, fqn) not in tied:
                absent.append(f"{module}.{fqn}")
        extra = [
            f"{m}.{f}"
            for m, sub in initial.items()
            for f in sub
            if not any(o == (m, f) for o in self.owner.values())
        ]
        if absent or extra:
            raise ConfigError(
                [
                    ConfigIssue(
                        path="model",
                        value=f"absent from the plan: {sorted(absent)[:5]}; unknown to the reference: {sorted(extra)[:5]}",
                        rule="the plan's modules and the reference model must hold the same tensors",
                        fix="report this: the model family's split_state_dict and its modules disagree",
                    )
                ]
            )
        self.model.load_state_dict(sd, strict=False)

    def step(
        self, data, *, lr: float, apply_grads: dict[str, dict[str, torch.Tensor]] | None = None
    ) -> tuple[float, float, dict[str, dict[str, torch.Tensor]]]:
        """One optimizer step on ``data`` (StepData): returns (loss, grad norm, pre-clip grads by module),
        all of the reference's own computation: transformers' ``loss`` of ONE forward on the step's
        whole batch (:func:`step_batch`), backpropagated once.

        ``apply_grads`` (``{module: {FQN: full grad}}``, the plan's grads of this step): the update
        clips and applies those instead of the reference's own (a tensor the plan does not hold keeps
        the reference's gradient; the gradient comparison reports it as missing).
        """
        self.optimizer.zero_grad(set_to_none=True)
        batch = step_batch(data, pad_token_id=self.pad_token_id)
        if batch.num_label_tokens != data.num_label_tokens:
            raise DataError(
                f"step {data.step + 1}: the step's batch has {batch.num_label_tokens} label tokens after "
                f"the shift, the loader counted T={data.num_label_tokens}: the loss normalisers differ "
                "(a loader or packing bug)."
            )
        router = {} if self.router_coef is None else {"output_router_logits": True}
        inputs = dict(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            labels=batch.labels,
            mm_token_type_ids=batch.mm_token_type_ids,
            **reference_visual_kwargs(batch),  # images and videos apart
            **reference_audio_kwargs(batch),
        )
        out = self.model(**self.family.reference_kwargs(inputs), use_cache=False, **router)
        out.loss.backward()
        grads: dict[str, dict[str, torch.Tensor]] = {}
        params = [p for p in self.model.parameters() if p.grad is not None]
        for key, p in self.model.named_parameters():
            if p.grad is not None:
                module, fqn = self.owner[key]
                grads.setdefault(module, {})[fqn] = p.grad.detach().clone()
        norm = _grad_norm(params)
        applied = norm
        if apply_grads is not None:
            for key, p in self.model.named_parameters():
                module, fqn = self.owner[key]
                g = apply_grads.get(module, {}).get(fqn)
                if p.grad is not None and g is not None and g.shape == p.grad.shape:
                    p.grad.copy_(g)
            applied = _grad_norm(params)
        coef = min(1.0, self.grad_clip / (applied + CLIP_EPS)) if self.grad_clip > 0 else 1.0
        for p in params:
            p.grad.mul_(coef)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        return float(out.loss.detach()), norm, grads


def step_batch(data, *, pad_token_id: int) -> VLBatch:
    """The step's whole batch as transformers takes it: every sample of every data replica's
    micro-batches, in order, packed rows unpacked into their samples, right-padded to one tensor, the
    pixels fetched (``data.engine=ray``)."""
    rows = [one for mb in data.micro_batches for b in mb for one in unpacked(b)]
    rows = [dataclasses.replace(b, pixel_values=as_tensor(b.pixel_values)) for b in rows]
    return concat_batches(rows, pad_token_id=pad_token_id)


def _router_coef(hf_config) -> float | None:
    """``router_aux_loss_coef`` of a model whose transformers class adds the load-balancing loss when
    called with ``output_router_logits`` (its text config has that flag); None for a model without a router."""
    text = hf_config.get_text_config()
    if not hasattr(text, "output_router_logits"):
        return None
    return float(text.router_aux_loss_coef)


def definition_differs(config: RunConfig, data, *, router_coef: float | None) -> str:
    """Why the plan's loss on ``data`` (StepData) is not the reference's by definition, or ''.

    ``train.router_aux_loss=micro_batch`` with several micro-batches per replica takes the router's
    load-balancing term over each micro-batch's tokens; transformers' (the reference's) is over the
    step's batch."""
    n_mb = len(data.micro_batches)
    if router_coef is None or not router_coef or n_mb < 2 or config.train.router_aux_loss != "micro_batch":
        return ""
    return (
        f"train.router_aux_loss=micro_batch with {n_mb} micro-batches per LLM replica: the plan's router "
        "load-balancing term is each micro-batch's (weighted by its label tokens), the reference's is "
        "over the step's batch; they differ by definition. Fix: train.router_aux_loss=step (the default)"
    )


def _grad_norm(params: list[torch.Tensor]) -> float:
    """The global L2 norm of ``params``' gradients, summed in fp64."""
    return float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params)))


def compare_grads(
    plan: dict[str, dict[str, torch.Tensor]], ref: dict[str, dict[str, torch.Tensor]]
) -> tuple[dict[str, float], dict[str, str]]:
    """Max |plan - ref| per module over every parameter, and the worst parameter's FQN.

    A parameter of another shape counts as an infinite difference. A gradient present on one side
    only is compared with zero, which is what the absent side's ``None`` means (a parameter its
    forward never reads, such as transformers' unused audio marker embedding): so a missing gradient
    passes only where the other side's is zero too.
    """
    diffs, worst = {}, {}
    for module in sorted(set(plan) | set(ref)):
        p, r = plan.get(module, {}), ref.get(module, {})  # result dicts, not config
        best, name = 0.0, ""
        for fqn in sorted(set(p) | set(r)):
            if (fqn in p) != (fqn in r):
                one = p[fqn] if fqn in p else r[fqn]
                d = float(one.float().abs().max()) if one.numel() else 0.0
            elif p[fqn].shape != r[fqn].shape:
                d = math.inf
            else:
                d = float((p[fqn].float() - r[fqn].float()).abs().max()) if r[fqn].numel() else 0.0
            if d > best or not name:
                best, name = d, fqn
        diffs[module], worst[module] = best, name
    return diffs, worst


def check_verifiable(config: RunConfig) -> None:
    """verify compares in fp32: refuse a bf16 model or mixed precision up front (ConfigError)."""
    issues = []
    if config.model.dtype != "float32":
        issues.append(
            ConfigIssue(
                "model.dtype", config.model.dtype, "verify compares in fp32", "add model.dtype=float32"
            )
        )
    for name, m in config.modules.items():
        if m.mixed_precision != "fp32":
            issues.append(
                ConfigIssue(
                    f"modules.{name}.mixed_precision",
                    m.mixed_precision,
                    "verify compares in fp32",
                    f"add modules.{name}.mixed_precision=fp32",
                )
            )
    if issues:
        raise ConfigError(issues)


def verify_plan(
    config: RunConfig,
    *,
    steps: int,
    loss_rtol: float = 1e-5,
    grad_atol: float = 1e-4,
    param_atol: float = 1e-4,
    on_step=None,
) -> VerifyReport:
    """Run ``steps`` steps of the plan and of the reference; return the per-step comparison.

    ``on_step(StepDiff, VerifyReport)`` is called after each step (live console output). Ray actors are shut down
    before returning, also on error.
    """

    check_verifiable(config)
    plan = compile_plan(config)
    loader = build_run_loader(config, plan.layouts)
    t = config.train
    # the run's own schedule (train.lr_schedule) over the verified steps, both sides at one LR a step
    warmup = round(t.warmup_ratio * steps) if t.warmup_ratio else t.warmup_steps
    schedule = make_schedule(t, total_steps=steps, warmup_steps=min(warmup, steps))
    meshes = ", ".join(f"{g.name} {dict(g.mesh) | _ep(g.layout)}" for g in plan.groups)
    report = VerifyReport(
        loss_rtol=loss_rtol,
        grad_atol=grad_atol,
        param_atol=param_atol,
        plan_summary=f"{meshes}, {config.placement}, hand-off {plan.handoff}",
    )

    trainer = Trainer(config, plan)  # connects Ray, reserves the plan, builds the groups
    try:
        compare_steps(
            trainer, config, loader=loader, lr=schedule.next_lr, steps=steps, report=report, on_step=on_step
        )
    finally:
        trainer.close()
    return report


def _ep(layout: ParallelLayout) -> dict[str, int]:
    """``{"ep": N}`` when the module's experts are sharded over N ranks (folded, so not a mesh axis)."""
    return {"ep": layout.ep} if layout.ep > 1 else {}


def compare_steps(
    trainer: Any,
    config: RunConfig,
    *,
    loader: Any,
    lr: Callable[[], float],
    steps: int,
    report: VerifyReport,
    on_step: Callable[[StepDiff, VerifyReport], None] | None = None,
) -> VerifyReport:
    """``steps`` steps of a running ``trainer`` against a reference started from its CURRENT weights
    (fresh AdamW states: start before the trainer's first step); appends to ``report``.

    Per step: the loss, the global grad norm, every gradient, and every parameter after the update
    (the reference updates with the plan's gradients: see the module docstring).
    """
    ref = ReferenceModel(
        model=config.model,
        modules=dict(config.modules),
        train=config.train,
        initial=trainer.full_state_dict(),
    )
    for _ in range(steps):
        data = next(loader)
        step_lr = lr()
        report.reference = report.reference or ref.definition(data)
        report.definition_differs = report.definition_differs or definition_differs(
            config, data, router_coef=ref.router_coef
        )
        res = trainer.step(data, lr=step_lr, collect_grads=True)
        ref_loss, ref_norm, ref_grads = ref.step(data, lr=step_lr, apply_grads=res.grads)
        diffs, worst = compare_grads(res.grads, ref_grads)
        pdiffs, pworst = compare_grads(trainer.full_state_dict(), ref.params())
        s = StepDiff(
            len(report.steps) + 1,
            float(res.loss),
            ref_loss,
            float(res.grad_norm),
            ref_norm,
            diffs,
            worst,
            pdiffs,
            pworst,
        )
        report.steps.append(s)
        if on_step is not None:
            on_step(s, report)
    return report


def render_step(s: StepDiff, report: VerifyReport, *, console) -> None:
    """One console line per step: losses, relative loss diff, grad norms, max grad and parameter
    diff per module (with the worst tensor)."""
    ok = "[green]ok[/]" if report.step_ok(s) else "[bold red]FAIL[/]"
    grads = "  ".join(f"{m} {d:.2e} ({s.worst_param[m]})" for m, d in s.grad_max_abs_diff.items())
    params = "  ".join(f"{m} {d:.2e} ({s.worst_param_after[m]})" for m, d in s.param_max_abs_diff.items())
    console.print(
        f"step {s.step:>3}  loss {s.loss:.6f} ref {s.ref_loss:.6f} rel {s.loss_rel_diff:.1e}  "
        f"|g| {s.grad_norm:.4f} ref {s.ref_grad_norm:.4f}  max|dg| {grads}  max|dp| {params}  {ok}"
    )


def render_report(report: VerifyReport, *, console) -> None:
    """The summary after the per-step lines (:func:`render_step`), without repeating them: the plan
    on a line of its own (never cut to a table's width), one row per module with the largest
    gradient and parameter difference over all steps and the step it came from, the worst loss and
    grad-norm differences, the failing steps, and a one-line verdict naming the tolerances."""

    console.print(
        f"[bold]dhp verify[/] vs unsplit transformers: {escape(report.plan_summary)}", soft_wrap=True
    )
    if report.reference:
        console.print(f"reference: {escape(report.reference)}", soft_wrap=True)
    if report.definition_differs:
        console.print(
            f"[bold red]the plan's definition differs[/]: {escape(report.definition_differs)}", soft_wrap=True
        )
    modules = sorted({m for s in report.steps for m in s.grad_max_abs_diff})
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for col in ("module", "max|dg|", "at step", "tensor", "max|dp|", "at step ", "tensor "):
        left = col.strip() in ("module", "tensor")  # a long FQN folds onto the next line, never "…"
        table.add_column(col, justify="left" if left else "right", overflow="fold" if left else "ellipsis")
    for m in modules:
        g = max((s for s in report.steps if m in s.grad_max_abs_diff), key=lambda s: s.grad_max_abs_diff[m])
        row = [m, f"{g.grad_max_abs_diff[m]:.1e}", str(g.step), g.worst_param[m]]
        with_p = [s for s in report.steps if m in s.param_max_abs_diff]
        if with_p:
            p = max(with_p, key=lambda s: s.param_max_abs_diff[m])
            row += [f"{p.param_max_abs_diff[m]:.1e}", str(p.step), p.worst_param_after[m]]
        else:
            row += ["-", "-", "-"]
        table.add_row(*row)
    if modules:
        console.print(table)
    if report.steps:
        loss = max(report.steps, key=lambda s: s.loss_rel_diff)
        norm = max(report.steps, key=lambda s: s.grad_norm_rel_diff)
        console.print(
            f"worst loss rel diff {loss.loss_rel_diff:.1e} (step {loss.step}), "
            f"worst grad-norm rel diff {norm.grad_norm_rel_diff:.1e} (step {norm.step})"
        )
    failing = [str(s.step) for s in report.steps if not report.step_ok(s)]
    if failing:
        console.print(
            f"[bold red]failing steps[/]: {', '.join(failing)} (their lines above say which module)"
        )
    verdict = "[bold green]PASS" if report.passed else "[bold red]FAIL"
    if report.definition_differs:
        verdict += " (the plan's definition differs from the reference's, see above)"
    console.print(
        f"{verdict}[/]: loss and grad norm within {report.loss_rtol:g} relative, every parameter's gradient "
        f"within {report.grad_atol:g} and every parameter after the update within {report.param_atol:g} "
        f"absolute, over {len(report.steps)} step(s)"
    )
