"""Rich tables for ``dhp plan --dry-run``: groups, placement, and per-rank memory by component."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dhp.ops.linear_attn import kernel_note
from dhp.plan.advice import oom_advice
from dhp.plan.types import Plan
from dhp.term import percent

GIB = float(1 << 30)


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _ranges(values: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def groups_table(plan: Plan) -> Table:
    table = Table(title=f"plan '{plan.name}': {plan.placement} on {plan.device}, hand-off {plan.handoff}")
    for col in (
        "group",
        "world",
        "mesh",
        "params (total / active)",
        "nodes",
        "GPUs (global)",
        "GPU fraction",
    ):
        table.add_column(col)
    for g in plan.groups:
        mesh = " x ".join(f"{a}={d}" for a, d in g.mesh.items())
        moe = g.ranks[0].memory.moe or {}
        ep, etp = moe.get("ep", 1), moe.get("etp", 1)
        mesh += f" (ep={ep} folded over dp x fsdp x sp)" if ep > 1 else ""
        mesh += f" (etp={etp}: the TP ranks cut the experts' work)" if etp > 1 else ""
        nodes = sorted({r.node for r in g.ranks})
        gpus = _ranges([r.global_gpu for r in g.ranks])
        fracs = sorted({r.gpu_fraction for r in g.ranks})
        table.add_row(
            g.name,
            str(g.world_size),
            mesh,
            f"{g.param_count / 1e9:.2f}B / {g.active / 1e9:.2f}B",
            _ranges(nodes),
            gpus,
            ",".join(f"{f:g}" for f in fracs),
        )
    pipes = [_pipeline_line(g) for g in plan.groups if g.stage_layers]
    if pipes:
        table.caption = "\n".join(pipes)
    if plan.kernels:  # a slow torch fallback on a GPU is named here, never silent
        table.caption = Text(  # Text, not markup: the fix names the extra "dhp[gpu]"
            "linear-attention kernel: "
            + "; ".join(f"{m} {kernel_note(plan.device, k)}" for m, k in plan.kernels.items())
        )
    return table


def _pipeline_line(g) -> str:
    """A group's pipeline: degrees, schedule, the cut and each pipeline rank's GPUs."""
    lay = g.layout
    virtual = f" x {lay.pp_virtual} stages per rank" if lay.pp_virtual > 1 else ""
    return (
        f"{g.name} pipeline: pp={lay.pp}{virtual}, schedule {lay.pp_schedule}, decoder layers per stage "
        f"{'+'.join(str(n) for n in g.stage_layers)} (first: embedding + hand-off, last: norm, lm_head, "
        f"loss); {lay.stage_world} ranks per stage"
    )


def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return "?"
    return f"{x:.4g}{unit}" if isinstance(x, float) and not x.is_integer() else f"{int(x)}{unit}"


def workload_table(plan: Plan) -> Table | None:
    """What the plan's numbers are for (``dhp.plan.workload``): each module's bound and timed
    micro-batch, the batch, the per-sample media and lengths, the tokens per step."""
    w = plan.workload
    if not w:
        return None
    b = w["batch"]
    table = Table(
        title=f"workload ({w['source']}): micro-batch {b['micro_batch_size']} samples per LLM replica, "
        f"global batch {b['global_batch_size']}, {b['micro_batches_per_step']} micro-batches per step"
    )
    for col in ("module", "replicas", "bound (seq_len; memory)", "micro-batch timed", "per rank"):
        table.add_column(col, justify="left" if col == "module" else "right")
    for name, m in w["modules"].items():
        if "patches_per_micro_batch" in m:
            bound, timed = f"{m['seq_len']} patches", _num(m["patches_per_micro_batch"], " patches")
            rank = f"{_num(m['patches_per_rank'], ' patches')} (sp={m['sp']})"
        else:
            bound = f"{m['seq_len']} tokens/row"
            timed, rank = f"{m['rows_per_micro_batch']} x {m['tokens_per_row']} tokens", ""
        table.add_row(name, str(m["replicas"]), bound, timed, rank)
    s, t = w["per_sample"], w["tokens_per_step"]
    table.caption = (
        f"per sample: {_num(s['images'])} images, {_num(s['videos'])} videos ({_num(s['video_frames'])} "
        f"frames), {_num(s['audio'])} audio; {_num(s['llm_tokens'])} LLM tokens (max "
        f"{_num(s['llm_tokens_max'])}), {_num(s['vision_patches'])} patches (max {_num(s['vision_patches_max'])})"
        f"\nper step: {_num(t['text'])} LLM tokens ({_num(t['llm_padded'])} with padding), "
        f"{_num(t['vision'])} patches"
    )
    return table


def placement_table(plan: Plan) -> Table:
    table = Table(title="Ray placement groups (one per node)")
    for col in ("pg", "node", "strategy", "bundles", "bundle", "GPUs (global)"):
        table.add_column(col)
    for i, pg in enumerate(plan.placement_groups):
        kinds = sorted({tuple(sorted(b.items())) for b in pg.bundles})
        bundle = "; ".join(", ".join(f"{k}: {v:g}" for k, v in kind) for kind in kinds)
        table.add_row(
            str(i), str(pg.node), pg.strategy, str(len(pg.bundles)), bundle, _ranges(list(pg.global_gpus))
        )
    if plan.routing:
        table.caption = "routing (consumer replica <- producer ranks): " + "; ".join(
            f"replica {r.consumer_replica} (ranks {_ranges(list(r.consumer_ranks))}) <- {r.producer} ranks "
            f"{_ranges(list(r.producer_ranks))}"
            for r in plan.routing
        )
    return table


def rank_table(plan: Plan) -> Table:
    """One row per GPU: which rank of each group sits there, with its mesh coordinates."""
    table = Table(title="ranks per GPU (rank: mesh coordinates)")
    for col in ("node", "gpu", "pg/bundle", *(g.name for g in plan.groups)):
        table.add_column(col)
    cells: dict[int, dict[str, str]] = {}
    where: dict[int, tuple[int, int, str]] = {}
    for g in plan.groups:
        for r in g.ranks:
            coords = " ".join(f"{a}{r.coords[a]}" for a in g.mesh if g.mesh[a] > 1)
            cells.setdefault(r.global_gpu, {})[g.name] = f"{r.rank}: {coords}" if coords else str(r.rank)
            where[r.global_gpu] = (r.node, r.gpu, f"{r.placement_group}/{r.bundle_index}")
    for gpu in sorted(cells):
        node, local, bundle = where[gpu]
        table.add_row(str(node), str(local), bundle, *(cells[gpu].get(g.name, "-") for g in plan.groups))
    return table


def memory_table(plan: Plan) -> Table:
    table = Table(title="memory per rank by module (GiB; every rank of a group is alike)")
    cols = (
        "group",
        "ranks",
        "B/param p+g+o",
        "params",
        "grads",
        "optimizer",
        "activations",
        "peak alone",
        "at",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("group", "at") else "right")
    notes = []
    for g, label, ranks in _memory_rows(plan):
        m = ranks[0].memory
        bpp = m.bytes_per_param
        table.add_row(
            label,
            _ranges([r.rank for r in ranks]),
            f"{bpp['params']}+{bpp['grads']}+{bpp['optimizer']}",
            gib(m.params),
            gib(m.grads),
            gib(m.optimizer),
            gib(m.activations),
            gib(m.total),
            m.peak_phase,
        )
        notes.append(
            f"{label} saved activations / micro-batch: "
            + ", ".join(f"{k} {gib(v)}" for k, v in m.detail.items() if v)
        )
        for phase, terms in m.work.items():
            if any(terms.values()):
                notes.append(
                    f"  {phase} transients: " + ", ".join(f"{k} {gib(v)}" for k, v in terms.items() if v)
                )
        if g.stage_layers and sum(m.detail.values()):
            flight = m.activations / sum(m.detail.values())
            notes.append(f"  {flight:.3g} micro-batches of activations in flight ({g.layout.pp_schedule})")
        if m.loss_chunk_tokens:
            notes.append(f"  loss chunk: {m.loss_chunk_tokens} tokens")
        notes += _moe_notes(m.moe) + _linear_notes(m.linear)
        if m.optimizer_impl:
            notes.append(f"  optimizer: AdamW {m.optimizer_impl} (train.optimizer.impl)")
    table.caption = "\n".join(notes)
    return table


def _memory_rows(plan: Plan) -> list[tuple]:
    """(group, row label, ranks) per memory row: a group's ranks, or each pipeline rank's with stages."""
    out = []
    for g in plan.groups:
        lay = g.layout
        if not g.stage_layers:
            out.append((g, g.name, list(g.ranks)))
            continue
        for s in range(lay.pp):
            ranks = [r for r in g.ranks if lay.pp_rank(r.rank) == s]
            out.append((g, f"{g.name} pp{s}", ranks))
    return out


def _moe_notes(moe: dict) -> list[str]:
    if not moe:
        return []
    by_ep = ", ".join(f"ep={e}: {gib(b)}" for e, b in moe["expert_state_bytes_by_ep"].items())
    shards = moe["expert_optimizer_shards"]
    head = f"  MoE: {moe['moe_blocks']} blocks x {moe['experts']} experts, "
    if moe.get("expert_fsdp"):  # the experts' params, grads and states all cut over edp too
        etp = f" x etp={moe['etp']}" if moe.get("etp", 1) > 1 else ""
        line = (
            f"{head}ep={moe['ep']}{etp} x edp={moe['edp']} (expert FSDP): 1/{moe['expert_param_shards']} "
            f"of the experts per rank ({moe['experts_per_rank']} experts per all-to-all rank, sharded over "
            f"edp)"
        )
    else:
        zero1 = f" (AdamW states ZeRO-1 over edp: 1/{shards} each)" if shards > 1 else ""
        etp = f", etp={moe['etp']}" if moe.get("etp", 1) > 1 else ""
        line = (
            f"{head}ep={moe['ep']}{etp} (edp={moe['edp']}): {moe['experts_per_rank']} experts per rank, "
            f"replicated over edp{zero1}"
        )
    return [
        f"{line}; expert params+grads+optimizer {gib(moe['expert_state_bytes'])} per rank",
        f"  expert states per rank by ep: {by_ep}",
        f"  dispatch+combine buffers / micro-batch: balanced router {gib(moe['dispatch_combine_block_bytes'])}"
        f" per MoE block, {gib(moe['dispatch_combine_saved_bytes'])} saved for backward; fully unbalanced "
        f"{gib(moe['dispatch_combine_worst_block_bytes'])} and {gib(moe['dispatch_combine_worst_saved_bytes'])}"
        f" (the verdict uses the {moe['verdict_uses']} router's; peak alone {gib(moe['peak_bytes'])}, "
        f"worst case {gib(moe['worst_case_peak_bytes'])})",
    ]


def _linear_notes(lin: dict) -> list[str]:
    if not lin:
        return []
    return [
        f"  linear attention: {lin['linear_blocks']} linear + {lin['full_blocks']} full blocks; recurrent "
        f"state {lin['state_bytes_per_sequence'] / 2**20:.2f} MiB per sequence per rank; chunk states "
        f"(C={lin['chunk']}) {gib(lin['chunk_states_bytes'])} per block"
    ]


def device_table(plan: Plan) -> Table:
    table = Table(
        title=f"per GPU (GiB): device {gib(plan.device_memory_bytes)}; peak = max over the step's phases"
    )
    for col in ("node", "GPUs", "groups", "reserve", "usable", "peak", "peak phase", "margin", "verdict"):
        table.add_column(col)
    rows: dict[tuple, list[int]] = {}
    for d in plan.devices:
        key = (d.node, d.groups, d.reserve, d.budget, d.total, d.peak_phase, d.margin, d.fits)
        rows.setdefault(key, []).append(d.gpu)
    for (node, groups, reserve, budget, total, phase, margin, fits), gpus in rows.items():
        verdict = "[green]fits" if fits else "[bold red]OOM"
        table.add_row(
            str(node),
            _ranges(gpus),
            "+".join(groups),
            gib(reserve),
            gib(budget),
            gib(total),
            phase,
            gib(margin),
            verdict,
        )
    worst = min(plan.devices, key=lambda d: d.margin)
    table.caption = f"at the peak ({worst.peak_phase}) of GPU {worst.global_gpu}: " + ", ".join(
        f"{k} {gib(v)}" for k, v in sorted(worst.peak_terms.items(), key=lambda kv: -kv[1]) if v >= GIB / 100
    )
    moe = max(plan.devices, key=lambda d: d.worst_case_total - d.budget)
    if moe.worst_case_total:
        table.caption += (
            f"\nMoE router fully unbalanced (not the verdict's case): peak {gib(moe.worst_case_total)} of "
            f"{gib(moe.budget)} usable on GPU {moe.global_gpu}: "
            + ("would fit" if moe.worst_case_total <= moe.budget else "would OOM")
        )
    return table


def estimate_table(plan: Plan) -> Table | None:
    """The step-time estimate: per module seconds per step, and the totals."""
    est = plan.estimate
    if est is None:
        return None
    table = Table(
        title=(
            f"step-time estimate (profile: {est['profile']}; {est['provenance']}): "
            f"{est['step_time_s']:.3f} s/step, "
            f"{est['vision_tokens_per_s']:.0f} encoder tok/s, {est['text_tokens_per_s']:.0f} text tok/s, "
            f"MFU {percent(est['mfu'])}, {est['micro_batches']} micro-batches, bottleneck {est['bottleneck']}"
        )
    )
    cols = (
        "module",
        "fwd s",
        "bwd s",
        "comm s",
        "a2a s",
        "grad sync s",
        "optim s",
        "idle s",
        "recompute TFLOP",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "module" else "right")
    keys = ("fwd_s", "bwd_s", "comm_s", "a2a_s", "grad_sync_s", "optim_s", "idle_s")
    for name, m in est["modules"].items():
        table.add_row(name, *(f"{m[k]:.3f}" for k in keys), f"{m['recompute_tflops']:.1f}")
    pipes = [
        f"{name} pipeline: bubble {m['pp_bubble_s']:.3f} s, stage sends {m['pp_p2p_s']:.3f} s per step "
        "(fwd/bwd s: the slowest pipeline rank's; the encoders run before and after the pipeline)"
        for name, m in est["modules"].items()
        if "pp_bubble_s" in m
    ]
    if pipes:
        table.caption = "\n".join(pipes)
    return table


def render_plan(plan: Plan, *, console: Console, reserved: bool = False) -> None:
    """Print the plan's tables and a one-line verdict to ``console``."""
    tables = (
        groups_table(plan),
        workload_table(plan),
        placement_table(plan),
        rank_table(plan),
        memory_table(plan),
        device_table(plan),
        estimate_table(plan),
    )
    for table in tables:
        if table is not None:
            console.print(table)
    verdict = "[green]fits" if plan.fits else "[bold red]does NOT fit (OOM)"
    console.print(f"verdict: {verdict}; smallest margin {gib(plan.min_margin)} GiB")
    for line in oom_advice(plan):
        console.print(Text(line))
    if reserved:
        console.print("[green]placement groups reserved on the Ray cluster and released")
