"""Per-module and cross-module validation rules (degrees, placement, cluster fit, batches, data).

Called by :func:`dhp.validation.validate.validate` once the model and cluster are known. Every rule
appends to the shared :class:`~dhp.config.issues.Issues` and never raises.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig

from dhp.config.constants import BAD_SAMPLE_POLICIES, DATA_KINDS
from dhp.config.issues import Issues
from dhp.config.plan_space import (
    ModuleAxes,
    declared_axes,
    layout_ok,
    module_problems,
    pipeline_micro_batch_problems,
    placement_problems,
)
from dhp.config.validate_data_keys import MARKERS_PER_VISUAL, synthetic_sample_tokens
from dhp.layout import module_layout
from dhp.models.graph import known_consumer, known_image_module
from dhp.models.registry import family_names, get_arch


def _divides(issues: Issues, *, path: str, value: int, by: int, by_name: str, what: str) -> None:
    if by > 0:
        issues.check(
            value % by == 0,
            path,
            by,
            f"{what} ({by_name}={value}) is not divisible by {path.rsplit('.', 1)[1]}={by}",
            f"choose {path.rsplit('.', 1)[1]} among the divisors of {value}",
        )


def module_axes(name: str, model: DictConfig) -> ModuleAxes | None:
    """What module ``name`` of the model's family supports (None: unknown family, or architecture
    numbers the family rejected: those are reported by the family's own validation)."""
    if model.family not in family_names():
        return None
    try:
        return declared_axes(get_arch(model.family), name, model)
    except (KeyError, ValueError, TypeError):
        return None


def _validate_module(name: str, mod: DictConfig, cfg: DictConfig, issues: Issues) -> None:
    prefix = f"modules.{name}"
    par = module_layout(mod)
    issues.check(mod.seq_len > 0, f"{prefix}.seq_len", mod.seq_len, "must be > 0", "set a positive length")
    problems = module_problems(
        name,
        gpus=mod.gpus,
        layout=par,
        axes=module_axes(name, cfg.model),
        gpus_per_node=cfg.cluster.gpus_per_node,
        activation_checkpointing=mod.activation_checkpointing,
        mixed_precision=mod.mixed_precision,
    )
    issues.items.extend(problems)
    if not layout_ok(mod.gpus, par):
        return  # a degree < 1: the length checks below would divide by zero
    if name == known_image_module(cfg.model.family):  # patches: merged spatial_merge_size^2 at a time
        v = cfg.model.vision
        unit = v.spatial_merge_size**2
        if mod.seq_len > 0:
            issues.check(
                mod.seq_len % unit == 0 and mod.seq_len >= unit * par.sp,
                f"{prefix}.seq_len",
                mod.seq_len,
                f"patches per micro-batch must be a multiple of spatial_merge_size^2={unit} and give "
                f"each of the sp={par.sp} ranks at least {unit}",
                f"use a multiple of {unit} that is >= {unit * par.sp}",
            )
    if name == known_consumer(cfg.model.family):
        lm = cfg.model.llm
        issues.check(
            mod.seq_len <= lm.max_position_embeddings,
            f"{prefix}.seq_len",
            mod.seq_len,
            f"longer than model.llm.max_position_embeddings={lm.max_position_embeddings}",
            "shorten the sequence",
        )


def validate_modules(cfg: DictConfig, issues: Issues) -> None:
    """Degrees, divisibility by heads/KV heads/vocab, TP inside a node, lengths and dtypes."""
    for name, mod in cfg.modules.items():
        _validate_module(str(name), mod, cfg, issues)
    trainable = [n for n, m in cfg.modules.items() if not m.freeze]
    issues.check(
        bool(trainable) or not cfg.modules,
        "modules",
        "all frozen",
        "every module has freeze=true, so nothing would train",
        "set freeze=false on at least one module",
    )


def validate_run(cfg: DictConfig, issues: Issues) -> None:
    """Placement, cluster fit, N:M routing between groups, hand-off, and the optimisation loop."""
    layouts = {str(n): module_layout(m) for n, m in cfg.modules.items()}
    mods = {str(n): m for n, m in cfg.modules.items() if layout_ok(m.gpus, layouts[str(n)])}
    reps = {n: layouts[n].num_replicas for n in mods}
    consumer = known_consumer(cfg.model.family)  # the loss module (None: an unknown family)
    if len(mods) == len(cfg.modules):
        issues.items.extend(
            placement_problems(
                {n: m.gpus for n, m in mods.items()},
                reps,
                placement=cfg.placement,
                handoff=cfg.handoff,
                device=cfg.cluster.device,
                total_gpus=cfg.cluster.nodes * cfg.cluster.gpus_per_node,
                consumer=consumer,
            )
        )
        if consumer in reps:
            pairs = [(reps[p], reps[consumer]) for p in reps if p != consumer]
            if all(max(pair) % min(pair) == 0 for pair in pairs):
                _validate_batch(cfg.train, [rv for rv, _ in pairs], reps[consumer], consumer, issues)
    for name in mods:  # a pipeline schedule's micro-batches are the step's per replica
        issues.items.extend(
            pipeline_micro_batch_problems(
                name,
                layouts[name],
                global_batch_size=cfg.train.global_batch_size,
                micro_batch_size=cfg.train.micro_batch_size,
            )
        )
        coef = (cfg.model.llm.extra or {}).get("router_aux_loss_coef", 0) if name == consumer else 0
        issues.check(  # each stage takes its router share from the step's sums: the step pass
            layouts[name].pp <= 1 or not coef or cfg.train.router_aux_loss == "step",
            "train.router_aux_loss",
            cfg.train.router_aux_loss,
            f"modules.{name} has pipeline stages and a router load-balancing loss (coefficient {coef}): "
            "each stage's routers take their share from the step's routing sums, which the "
            "step-statistics pass gives; per micro-batch no stage sees every layer's routers",
            "set train.router_aux_loss=step (transformers' loss on the step's batch)",
        )
    _validate_train(cfg.train, issues)


def _validate_batch(train: DictConfig, producers: list[int], rl: int, consumer: str, issues: Issues) -> None:
    """The step's batch against the loss module's (``consumer``) ``rl`` replicas, and each of its
    micro-batches against every producer's replicas (``producers``) that split it."""
    if train.micro_batch_size <= 0 or train.global_batch_size <= 0:
        return
    unit = train.micro_batch_size * rl
    issues.check(
        train.global_batch_size % unit == 0,
        "train.global_batch_size",
        train.global_batch_size,
        f"must be a multiple of micro_batch_size*{consumer} replicas = {train.micro_batch_size}*{rl} = {unit}",
        f"use a multiple of {unit}",
    )
    split = math.lcm(*(rv // rl for rv in producers if rv > rl and rl > 0), 1)
    if split > 1:
        issues.check(
            train.micro_batch_size % split == 0,
            "train.micro_batch_size",
            train.micro_batch_size,
            f"each LLM replica's micro-batch is split over {split} encoder replicas",
            f"use a multiple of {split}",
        )


def _validate_train(train: DictConfig, issues: Issues) -> None:
    # the run's length (train.steps or train.epochs) and its warmup: validate_finetune.py
    issues.positive(train, "train", ["global_batch_size", "micro_batch_size", "lr", "log_every"])
    issues.check(
        0.0 <= train.min_lr_ratio <= 1.0,
        "train.min_lr_ratio",
        train.min_lr_ratio,
        "must be in [0, 1]",
        "e.g. 0.1",
    )
    betas = list(train.betas)
    issues.check(
        len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas),
        "train.betas",
        betas,
        "must be two numbers in [0, 1)",
        "e.g. [0.9, 0.95]",
    )
    for key in ("weight_decay", "grad_clip", "checkpoint_every"):
        issues.check(train[key] >= 0, f"train.{key}", train[key], "must be >= 0", "use 0 to disable")
    issues.check(train.keep_last >= 1, "train.keep_last", train.keep_last, "must be >= 1", "keep at least 1")


def validate_data(cfg: DictConfig, issues: Issues) -> None:
    """Data source, image size bounds, and synthetic samples against the modules' lengths."""
    data = cfg.data
    issues.one_of(data.on_bad_sample, "data.on_bad_sample", BAD_SAMPLE_POLICIES)
    issues.check(data.num_workers >= 0, "data.num_workers", data.num_workers, "must be >= 0", "use 0")
    issues.positive(data, "data", ["min_pixels", "max_pixels"])
    issues.check(
        data.min_pixels <= data.max_pixels,
        "data.min_pixels",
        data.min_pixels,
        f"must be <= data.max_pixels={data.max_pixels}",
        "lower min_pixels",
    )
    if not issues.one_of(data.kind, "data.kind", DATA_KINDS):
        return
    if data.kind == "llava":
        issues.check(
            bool(data.datasets),
            "data.datasets",
            [],
            "data.kind=llava needs at least one dataset",
            "give your data with data.path=FILE (docs/DATA.md), list data.datasets, or use data=synthetic",
        )
        for i, ds in enumerate(data.datasets):
            issues.check(ds.weight > 0, f"data.datasets.{i}.weight", ds.weight, "must be > 0", "e.g. 1.0")
        _validate_image_fits(cfg, issues)
        return
    syn = data.synthetic
    issues.positive(syn, "data.synthetic", ["num_samples", "patches", "images_per_sample", "text_tokens"])
    _validate_synthetic_lengths(cfg, issues)


def _validate_image_fits(cfg: DictConfig, issues: Issues) -> None:
    """One image at data.max_pixels must fit the encoder's micro-batch, or every large image fails."""
    v, image = cfg.model.vision, known_image_module(cfg.model.family)
    if image not in cfg.modules or v.patch_size <= 0 or cfg.data.max_pixels <= 0:
        return
    patches = cfg.data.max_pixels // (v.patch_size**2)
    seq = cfg.modules[image].seq_len
    issues.check(
        patches <= seq,
        f"modules.{image}.seq_len",
        seq,
        f"one image at data.max_pixels={cfg.data.max_pixels} has about {patches} patches",
        f"raise it to at least {patches} (times images per micro-batch), or lower data.max_pixels",
    )


def _validate_synthetic_lengths(cfg: DictConfig, issues: Issues) -> None:
    syn, v, mods = cfg.data.synthetic, cfg.model.vision, cfg.modules
    unit = v.spatial_merge_size**2
    if syn.patches <= 0 or unit <= 0 or syn.text_tokens <= 0 or syn.images_per_sample <= 0:
        return
    issues.check(
        syn.patches % unit == 0,
        "data.synthetic.patches",
        syn.patches,
        f"must be a multiple of spatial_merge_size^2={unit}",
        f"use a multiple of {unit}",
    )
    micro = cfg.train.micro_batch_size
    temporal = max(int(v.temporal_patch_size), 1)
    video_patches = syn.videos_per_sample * (syn.video_frames // temporal) * syn.patches
    image, consumer = known_image_module(cfg.model.family), known_consumer(cfg.model.family)
    if image in mods and micro > 0:
        need = (syn.patches * syn.images_per_sample + video_patches) * micro
        issues.check(
            need <= mods[image].seq_len,
            f"modules.{image}.seq_len",
            mods[image].seq_len,
            f"a micro-batch of synthetic samples has {need} patches",
            f"set it >= {need}",
        )
    if consumer in mods:
        need = synthetic_sample_tokens(
            syn,
            spatial_merge_size=v.spatial_merge_size,
            temporal_patch_size=temporal,
            text_tokens=max(syn.text_tokens, syn.text_tokens_max),
        )
        issues.check(
            need <= mods[consumer].seq_len,
            f"modules.{consumer}.seq_len",
            mods[consumer].seq_len,
            f"the longest synthetic sample has {need} tokens (image and video tokens, "
            f"{MARKERS_PER_VISUAL} markers each, and text)",
            f"set it >= {need}",
        )
