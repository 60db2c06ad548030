"""Per-module and cross-module validation rules (degrees, placement, cluster fit, batches, data).

Called by :func:`dhp.config.validate.validate` once the model and cluster are known. Every rule
appends to the shared :class:`~dhp.config.issues.Issues` and never raises.
"""

from __future__ import annotations

from omegaconf import DictConfig

from dhp.config.ac import parse_ac_mode
from dhp.config.constants import (
    BAD_SAMPLE_POLICIES,
    DATA_KINDS,
    HANDOFFS,
    MIXED_PRECISIONS,
    PARALLEL_AXES,
    PLACEMENTS,
)
from dhp.config.handoff import resolve_handoff
from dhp.config.issues import Issues
from dhp.layout import RankLayout


def _divides(issues: Issues, *, path: str, value: int, by: int, by_name: str, what: str) -> None:
    if by > 0:
        issues.check(
            value % by == 0,
            path,
            by,
            f"{what} ({by_name}={value}) is not divisible by {path.rsplit('.', 1)[1]}={by}",
            f"choose {path.rsplit('.', 1)[1]} among the divisors of {value}",
        )


def _validate_degrees(name: str, mod: DictConfig, issues: Issues) -> bool:
    prefix = f"modules.{name}"
    par = mod.parallel
    ok = True
    for axis in PARALLEL_AXES:
        ok &= issues.check(
            par[axis] >= 1, f"{prefix}.parallel.{axis}", par[axis], "must be >= 1", "use 1 to disable"
        )
    ok &= issues.check(
        mod.gpus > 0, f"{prefix}.gpus", mod.gpus, "must be > 0", "set the GPU count of this group"
    )
    issues.check(
        par.zero in (0, 1),
        f"{prefix}.parallel.zero",
        par.zero,
        "must be 0 (plain DP) or 1 (ZeRO-1)",
        "use fsdp=N for ZeRO-3-style sharding",
    )
    issues.check(
        not (par.zero == 1 and par.fsdp > 1),
        f"{prefix}.parallel.zero",
        par.zero,
        "ZeRO-1 and FSDP both shard the optimizer state",
        "set zero=0 when fsdp > 1",
    )
    issues.check(
        not (par.sp > 1 and par.tp > 1),
        f"{prefix}.parallel",
        {"sp": par.sp, "tp": par.tp},
        "sp and tp are mutually exclusive inside one module",
        "use sp for the vision encoder and tp for the LLM",
    )
    if ok:
        product = RankLayout.from_parallel(par).world_size
        issues.check(
            product == mod.gpus,
            f"{prefix}.gpus",
            mod.gpus,
            f"must equal dp*fsdp*sp*tp = {par.dp}*{par.fsdp}*{par.sp}*{par.tp} = {product}",
            f"set {prefix}.gpus={product} or change the degrees",
        )
    return ok


def _validate_module(name: str, mod: DictConfig, cfg: DictConfig, issues: Issues) -> None:
    prefix = f"modules.{name}"
    par = mod.parallel
    issues.check(mod.seq_len > 0, f"{prefix}.seq_len", mod.seq_len, "must be > 0", "set a positive length")
    issues.one_of(mod.mixed_precision, f"{prefix}.mixed_precision", MIXED_PRECISIONS)
    try:
        parse_ac_mode(mod.activation_checkpointing)
    except ValueError as e:
        issues.add(
            f"{prefix}.activation_checkpointing",
            mod.activation_checkpointing,
            str(e),
            f"set {prefix}.activation_checkpointing=full (or off, every_n:2)",
        )
    if not _validate_degrees(name, mod, issues):
        return  # a degree < 1: divisibility checks would divide by zero
    gpn = cfg.cluster.gpus_per_node
    if par.tp > 1:
        ok = issues.check(
            par.tp <= gpn,
            f"{prefix}.parallel.tp",
            par.tp,
            f"a TP group must stay inside one node (cluster.gpus_per_node={gpn})",
            f"use tp <= {gpn} and scale with dp/fsdp across nodes",
        )
        if ok:
            _divides(
                issues,
                path=f"{prefix}.parallel.tp",
                value=gpn,
                by=par.tp,
                by_name="gpus_per_node",
                what="TP groups must tile a node",
            )
    if name == "vision":
        v = cfg.model.vision
        for axis in ("sp", "tp"):
            _divides(
                issues,
                path=f"{prefix}.parallel.{axis}",
                value=v.num_heads,
                by=par[axis],
                by_name="model.vision.num_heads",
                what="encoder heads",
            )
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
    if name == "llm":
        lm = cfg.model.llm
        for key in ("num_heads", "num_kv_heads", "vocab_size"):
            _divides(
                issues,
                path=f"{prefix}.parallel.tp",
                value=lm[key],
                by=par.tp,
                by_name=f"model.llm.{key}",
                what=f"LLM {key}",
            )
        issues.check(
            par.sp == 1,
            f"{prefix}.parallel.sp",
            par.sp,
            "sequence parallelism is implemented for the vision encoder only",
            "use tp (and dp/fsdp) for the LLM",
        )
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


def _module_ok(mod: DictConfig) -> bool:
    par = mod.parallel
    return (
        mod.gpus > 0
        and all(par[a] >= 1 for a in PARALLEL_AXES)
        and RankLayout.from_parallel(par).world_size == mod.gpus
    )


def validate_run(cfg: DictConfig, issues: Issues) -> None:
    """Placement, cluster fit, N:M routing between groups, and the optimisation loop."""
    mods = {str(n): m for n, m in cfg.modules.items()}
    total = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    if issues.one_of(cfg.placement, "placement", PLACEMENTS) and all(m.gpus > 0 for m in mods.values()):
        gpus = {n: m.gpus for n, m in mods.items()}
        if cfg.placement == "collocated":
            issues.check(
                len(set(gpus.values())) <= 1,
                "placement",
                cfg.placement,
                f"collocated groups must share one GPU set, but the GPU counts differ: {gpus}",
                "give every module the same gpus, or use placement=disaggregated",
            )
            need = max(gpus.values(), default=0)
        else:
            need = sum(gpus.values())
        issues.check(
            need <= total,
            "cluster",
            cfg.cluster.name,
            f"the {cfg.placement} groups need {need} GPUs but the cluster has "
            f"{cfg.cluster.nodes}x{cfg.cluster.gpus_per_node}={total}",
            "use a larger cluster profile or fewer GPUs per module",
        )
        if "vision" in mods and "llm" in mods and _module_ok(mods["vision"]) and _module_ok(mods["llm"]):
            rv = RankLayout.from_parallel(mods["vision"].parallel).num_replicas
            rl = RankLayout.from_parallel(mods["llm"].parallel).num_replicas
            issues.check(
                max(rv, rl) % min(rv, rl) == 0,
                "modules.vision.parallel",
                {"vision_replicas": rv, "llm_replicas": rl},
                "data-parallel replicas (dp*fsdp) of one module must divide the other's for N:M routing",
                "make one replica count a multiple of the other",
            )
            _validate_batch(cfg.train, rv, rl, issues)
        if issues.one_of(cfg.handoff, "handoff", HANDOFFS):
            _, problem = resolve_handoff(
                device=cfg.cluster.device, placement=cfg.placement, handoff=cfg.handoff
            )
            issues.check(
                problem is None,
                "handoff",
                cfg.handoff,
                f"{problem} (cluster.device={cfg.cluster.device}, placement={cfg.placement})",
                "use handoff=auto",
            )
    _validate_train(cfg.train, issues)


def _validate_batch(train: DictConfig, rv: int, rl: int, issues: Issues) -> None:
    if train.micro_batch_size <= 0 or train.global_batch_size <= 0:
        return
    unit = train.micro_batch_size * rl
    issues.check(
        train.global_batch_size % unit == 0,
        "train.global_batch_size",
        train.global_batch_size,
        f"must be a multiple of micro_batch_size*llm replicas = {train.micro_batch_size}*{rl} = {unit}",
        f"use a multiple of {unit}",
    )
    if rv > rl and rl > 0:
        issues.check(
            train.micro_batch_size % (rv // rl) == 0,
            "train.micro_batch_size",
            train.micro_batch_size,
            f"each LLM replica's micro-batch is split over {rv // rl} encoder replicas",
            f"use a multiple of {rv // rl}",
        )


def _validate_train(train: DictConfig, issues: Issues) -> None:
    issues.positive(train, "train", ["steps", "global_batch_size", "micro_batch_size", "lr", "log_every"])
    issues.check(
        0 <= train.warmup_steps <= max(train.steps, 0),
        "train.warmup_steps",
        train.warmup_steps,
        f"must be in [0, train.steps={train.steps}]",
        "shorten the warmup or train longer",
    )
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
            "list datasets (name, path, image_root) or use data=synthetic",
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
    v = cfg.model.vision
    if "vision" not in cfg.modules or v.patch_size <= 0 or cfg.data.max_pixels <= 0:
        return
    patches = cfg.data.max_pixels // (v.patch_size**2)
    seq = cfg.modules.vision.seq_len
    issues.check(
        patches <= seq,
        "modules.vision.seq_len",
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
    if "vision" in mods and micro > 0:
        need = syn.patches * syn.images_per_sample * micro
        issues.check(
            need <= mods.vision.seq_len,
            "modules.vision.seq_len",
            mods.vision.seq_len,
            f"a micro-batch of synthetic samples has {need} patches",
            f"set it >= {need}",
        )
    if "llm" in mods:
        # each image: its merged tokens between <|vision_start|> and <|vision_end|>
        need = (syn.patches // unit + 2) * syn.images_per_sample + syn.text_tokens
        issues.check(
            need <= mods.llm.seq_len,
            "modules.llm.seq_len",
            mods.llm.seq_len,
            f"a synthetic sample has {need} tokens (image tokens + 2 markers per image + text)",
            f"set it >= {need}",
        )
