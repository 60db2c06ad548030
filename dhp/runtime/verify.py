"""``dhp verify``: run a plan and the unsplit transformers model side by side and compare every step.

The plan runs through the real runtime (:class:`dhp.runtime.Trainer`, Ray actor groups, hand-offs)
with ``collect_grads=True``; the reference is the family's untouched transformers model
(``family.reference_model``) in THIS (driver) process, started from the plan's own initial weights, fed the same batches (the
union of all data replicas' micro-batches, normalised by the same global label-token count ``T``),
clipped by the same global norm and stepped by the same AdamW and LR schedule. Memory: the driver
holds one full fp32 copy of the model, its grads and Adam states, plus one full gradient copy of
the plan: tiny and small models only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dhp.config.schema import ModelConfig, ModuleConfig, RunConfig, TrainConfig
from dhp.data.remote import as_tensor
from dhp.errors import ConfigError, ConfigIssue
from dhp.ops.cross_entropy import shifted_ce_sum

CLIP_EPS = 1e-6  # clip coefficient = grad_clip / (norm + CLIP_EPS), as torch's clip_grad_norm_


@dataclass
class StepDiff:
    """One step: plan vs reference loss and grad norm, and the max |grad diff| per module."""

    step: int
    loss: float
    ref_loss: float
    grad_norm: float
    ref_grad_norm: float
    grad_max_abs_diff: dict[str, float]
    worst_param: dict[str, str]

    @property
    def loss_rel_diff(self) -> float:
        return abs(self.loss - self.ref_loss) / max(abs(self.ref_loss), 1e-12)


@dataclass
class VerifyReport:
    """All steps, the tolerances applied, and whether every step is within them."""

    steps: list[StepDiff] = field(default_factory=list)
    loss_rtol: float = 1e-5
    grad_atol: float = 1e-4
    plan_summary: str = ""

    def step_ok(self, s: StepDiff) -> bool:
        finite = math.isfinite(s.loss) and all(math.isfinite(v) for v in s.grad_max_abs_diff.values())
        return (
            finite
            and s.loss_rel_diff <= self.loss_rtol
            and all(v <= self.grad_atol for v in s.grad_max_abs_diff.values())
        )

    @property
    def passed(self) -> bool:
        return bool(self.steps) and all(self.step_ok(s) for s in self.steps)


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
        from dhp.models import get_family

        self.family = get_family(model.family)
        hf_config = self.family.hf_config(model)
        self.model = self.family.reference_model(hf_config)
        self.owner = self._owners()
        self._load(initial, hf_config)
        frozen = {m for m, c in modules.items() if c.freeze}
        for key, p in self.model.named_parameters(remove_duplicate=False):
            p.requires_grad_(self.owner[key][0] not in frozen)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay, eps=1e-8
        )
        self.grad_clip = train.grad_clip

    def _owners(self) -> dict[str, tuple[str, str]]:
        """HF state-dict key -> (module, module FQN), via the family's own split."""
        out = {}
        for key, t in self.model.state_dict().items():
            for module, sub in self.family.split_state_dict({key: t}).items():
                for fqn in sub:
                    out[key] = (module, fqn)
        return out

    def _load(self, initial: dict[str, dict[str, torch.Tensor]], hf_config) -> None:
        """Copy the plan's initial tensors in; tied parameters follow their source."""
        tied = {(m, f) for m in initial for f in self.family.tied_parameters(m, hf_config)}
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

    def step(self, data, *, lr: float) -> tuple[float, float, dict[str, dict[str, torch.Tensor]]]:
        """One optimizer step on ``data`` (StepData): returns (loss, grad norm, pre-clip grads by module)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in data.micro_batches:
            for b in micro:
                hidden = self.model.base_model(
                    input_ids=b.input_ids,
                    attention_mask=b.attention_mask,
                    pixel_values=as_tensor(b.pixel_values),  # data.engine=ray: fetched here
                    image_grid_thw=b.image_grid_thw,
                    mm_token_type_ids=b.mm_token_type_ids,
                    use_cache=False,
                ).last_hidden_state
                head = self.model.get_output_embeddings()
                loss_sum = shifted_ce_sum(hidden, head.weight, b.labels, bias=head.bias)
                (loss_sum / data.num_label_tokens).backward()
                total += float(loss_sum.detach())
        grads: dict[str, dict[str, torch.Tensor]] = {}
        params = [p for p in self.model.parameters() if p.grad is not None]
        for key, p in self.model.named_parameters():
            if p.grad is not None:
                module, fqn = self.owner[key]
                grads.setdefault(module, {})[fqn] = p.grad.detach().clone()
        norm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params)))
        coef = min(1.0, self.grad_clip / (norm + CLIP_EPS)) if self.grad_clip > 0 else 1.0
        for p in params:
            p.grad.mul_(coef)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        return total / data.num_label_tokens, norm, grads


def compare_grads(
    plan: dict[str, dict[str, torch.Tensor]], ref: dict[str, dict[str, torch.Tensor]]
) -> tuple[dict[str, float], dict[str, str]]:
    """Max |plan - ref| per module over every parameter, and the worst parameter's FQN.

    A parameter present on one side only, or of another shape, counts as an infinite difference
    (so a missing gradient can never pass).
    """
    diffs, worst = {}, {}
    for module in sorted(set(plan) | set(ref)):
        p, r = plan.get(module, {}), ref.get(module, {})  # result dicts, not config
        best, name = 0.0, ""
        for fqn in sorted(set(p) | set(r)):
            if fqn not in p or fqn not in r or p[fqn].shape != r[fqn].shape:
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
    on_step=None,
) -> VerifyReport:
    """Run ``steps`` steps of the plan and of the reference; return the per-step comparison.

    ``on_step(StepDiff, VerifyReport)`` is called after each step (live console output). Ray actors are shut down
    before returning, also on error.
    """
    from dhp.data import build_run_loader
    from dhp.plan import compile_plan
    from dhp.runtime.schedule import WarmupCosine

    check_verifiable(config)
    plan = compile_plan(config)
    loader = build_run_loader(config)
    t = config.train
    schedule = WarmupCosine(
        lr=t.lr, warmup_steps=t.warmup_steps, total_steps=steps, min_lr_ratio=t.min_lr_ratio
    )
    meshes = ", ".join(f"{g.name} {dict(g.mesh)}" for g in plan.groups)
    report = VerifyReport(
        loss_rtol=loss_rtol,
        grad_atol=grad_atol,
        plan_summary=f"{meshes}, {config.placement}, hand-off {plan.handoff}",
    )
    from dhp.runtime.driver import Trainer

    trainer = Trainer(config, plan)  # connects Ray, reserves the plan, builds the groups
    try:
        ref = ReferenceModel(
            model=config.model, modules=dict(config.modules), train=t, initial=trainer.full_state_dict()
        )
        for i in range(steps):
            data = next(loader)
            lr = schedule.next_lr()
            res = trainer.step(data, lr=lr, collect_grads=True)
            ref_loss, ref_norm, ref_grads = ref.step(data, lr=lr)
            diffs, worst = compare_grads(res.grads, ref_grads)
            s = StepDiff(i + 1, float(res.loss), ref_loss, float(res.grad_norm), ref_norm, diffs, worst)
            report.steps.append(s)
            if on_step is not None:
                on_step(s, report)
    finally:
        trainer.close()
    return report


def render_step(s: StepDiff, report: VerifyReport, *, console) -> None:
    """One console line per step: losses, relative loss diff, grad norms, max grad diff per module."""
    ok = "[green]ok[/]" if report.step_ok(s) else "[bold red]FAIL[/]"
    grads = "  ".join(f"{m} {d:.2e} ({s.worst_param[m]})" for m, d in s.grad_max_abs_diff.items())
    console.print(
        f"step {s.step:>3}  loss {s.loss:.6f} ref {s.ref_loss:.6f} rel {s.loss_rel_diff:.1e}  "
        f"|g| {s.grad_norm:.4f} ref {s.ref_grad_norm:.4f}  max|dg| {grads}  {ok}"
    )


def render_report(report: VerifyReport, *, console) -> None:
    """A rich table of every step and a one-line verdict naming the tolerances."""
    from rich import box
    from rich.table import Table

    modules = sorted({m for s in report.steps for m in s.grad_max_abs_diff})
    table = Table(
        title=f"dhp verify vs unsplit transformers: {report.plan_summary}",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
    )
    for col in ("step", "loss", "ref loss", "rel", "|g|", "ref |g|"):
        table.add_column(
            col, justify="right", no_wrap=True, min_width={"step": 4, "loss": 8, "ref loss": 8}.get(col, 7)
        )
    for m in modules:
        table.add_column(f"max|dg|\n{m}", justify="right", no_wrap=True, min_width=7)
    for s in report.steps:
        cells = [str(s.step), f"{s.loss:.6f}", f"{s.ref_loss:.6f}", f"{s.loss_rel_diff:.1e}"]
        cells += [f"{s.grad_norm:.4f}", f"{s.ref_grad_norm:.4f}"]
        cells += [f"{s.grad_max_abs_diff[m]:.1e}" if m in s.grad_max_abs_diff else "-" for m in modules]
        table.add_row(*cells, style=None if report.step_ok(s) else "bold red")  # a failing step in red
    console.print(table)
    verdict = "[bold green]PASS" if report.passed else "[bold red]FAIL"
    console.print(
        f"{verdict}[/]: loss within {report.loss_rtol:g} relative and every parameter's gradient within "
        f"{report.grad_atol:g} absolute, over {len(report.steps)} step(s)"
    )
