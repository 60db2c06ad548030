"""``dhp report RUN_DIR``: PNG plots and a summary table of one run, read from its ``metrics.jsonl``.

Plots (one PNG each, in ``--out`` or ``<run_dir>/report``): loss (with the eval loss of each
``eval`` event beside the training curve), grad norm, learning rate,
tokens/s (vision and text), the per-module time split of each step (fwd/bwd/optimizer step and the
LLM's wait on the hand-off), and peak memory per rank. One continuous curve per run directory:
every restart and resume is marked on each step plot with a dashed vertical line, where a
``restart``/``resume`` event sits in ``metrics.jsonl`` (for a run from an older dhp without
events: a step that is not after the one before it, or a first step > 1). A plot or summary row
whose metric an older dhp did not record is left out. matplotlib is an optional extra
(``pip install -e .[plots]``).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dhp.errors import ConfigError, ConfigIssue
from dhp.metrics.rundir import Mark, RunLog, add_record, read_run_log
from dhp.metrics.runs import count_skipped
from dhp.term import percent

PARTS = ("fwd", "bwd", "step")


Restart = Mark  # where the run went back or resumed, and why (``dhp.metrics.rundir``)


def find_restarts(rows: list[dict[str, Any]]) -> list[Mark]:
    """The marks of a list of step records alone (no events: a run from an older dhp)."""
    log = RunLog()
    for r in rows:
        add_record(log, r, [])
    return log.marks


def _has(rows: list[dict[str, Any]], key: str) -> bool:
    """Whether every record has ``key`` (a record of an older dhp may not)."""
    return all(key in r for r in rows)


def _modules(rows: list[dict[str, Any]]) -> list[str]:
    """The modules with every per-part timing, in the records' order: producers first, the consumer
    (the module with the loss) last, as the driver's groups."""
    mods = [k.removesuffix("_fwd_s") for k in rows[0] if k.endswith("_fwd_s")]
    return [m for m in mods if all(_has(rows, f"{m}_{p}_s") for p in PARTS)]


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError(
            "dhp report draws with matplotlib, which is not installed. Fix: pip install -e '.[plots]' "
            "(or pip install matplotlib)"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_report(run_dir: Path, *, out_dir: Path | None = None) -> tuple[list[Path], list[dict[str, Any]]]:
    """Write the PNGs of ``run_dir`` into ``out_dir`` (default ``<run_dir>/report``); returns the
    paths and the metrics rows. ConfigError when the run has no metrics yet."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    log = read_run_log(path)
    rows = log.records
    if not rows:
        raise _nothing_to_report(run_dir, log)
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    restarts = log.marks
    x = list(range(len(rows)))  # record order: a restarted step appears again after the restart
    steps = [r["step"] for r in rows]
    title = f"{run_dir.parent.name}/{run_dir.name}"
    written = []

    def finish(fig, ax, name: str, ylabel: str) -> None:
        for rs in restarts:
            ax.axvline(rs.index - 0.5 if rs.index else 0, color="red", ls="--", lw=1)
            ax.annotate(
                rs.why,
                (rs.index, 1),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color="red",
            )
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ticks = x if len(x) <= 12 else x[:: max(1, len(x) // 10)]
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
        ax.grid(alpha=0.3)
        ax.set_title(f"{name} - {title}", fontsize=10)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        p = out / f"{name.replace(' ', '_').replace('/', '_')}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)

    for key, name, ylabel in (
        ("loss", "loss", "loss"),
        ("grad_norm", "grad norm", "global grad norm (before clipping)"),
        ("lr", "learning rate", "lr"),
    ):
        if not _has(rows, key):
            continue
        fig, ax = plt.subplots(figsize=(8, 3.6))
        ax.plot(x, [r[key] for r in rows], marker="o", ms=3, label="train" if log.evals else None)
        if key == "loss" and log.evals:
            ex, ey = eval_points(rows, log.evals)
            ax.plot(ex, ey, marker="s", ms=4, color="tab:orange", label="eval (data.eval)")
        finish(fig, ax, name, ylabel)

    if _has(rows, "tokens_per_s_vision") and _has(rows, "tokens_per_s_text"):
        fig, ax = plt.subplots(figsize=(8, 3.6))
        ax.plot(x, [r["tokens_per_s_vision"] for r in rows], marker="o", ms=3, label="vision (patches)")
        ax.plot(x, [r["tokens_per_s_text"] for r in rows], marker="s", ms=3, label="text (LLM tokens)")
        finish(fig, ax, "tokens per s", "tokens / s")
    mods = _modules(rows)
    if mods and _has(rows, "wait_s") and _has(rows, "step_s"):
        _time_split(plt, rows, x, mods, finish)
    if _has(rows, "peak_mem_bytes"):
        fig, ax = plt.subplots(figsize=(8, 3.6))
        ranks = sorted({k for r in rows for k in r["peak_mem_bytes"]})
        for k in ranks:
            ax.plot(x, [r["peak_mem_bytes"].get(k, float("nan")) / 2**20 for r in rows], marker=".", label=k)
        finish(fig, ax, "peak memory per rank", "MiB (cuda: allocated; cpu: RSS high-water)")
    return written, rows


def eval_points(rows: list[dict[str, Any]], evals: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """Each eval loss at the x of its step's record (the last record of that step: after a restart
    the step ran again), for the loss plot's second curve."""
    at = {r["step"]: i for i, r in enumerate(rows)}
    pts = [(at[e["step"]], e["eval_loss"]) for e in evals if e["step"] in at]
    return [i for i, _ in pts], [v for _, v in pts]


def _nothing_to_report(run_dir: Path, log: RunLog) -> ConfigError:
    """Why ``run_dir`` has no curve yet, and what to do."""
    path = run_dir / "metrics.jsonl"
    if log.failed is not None:
        tb = log.failed.get("traceback")
        rule = f"no step logged: the run failed at step {log.failed['step']}: {log.failed.get('reason', '')}"
        fix = f"read the tracebacks in {run_dir / tb}, fix the cause and run again" if tb else "run again"
    elif log.events:
        kinds = ", ".join(e["event"] for e in log.events)
        rule = f"no step logged in {path}, {len(log.events)} event(s) only ({kinds})"
        fix = (
            "resume the run (train.resume=auto), or pass a run directory that logged a step (see `dhp runs`)"
        )
    else:
        state = "missing" if not path.is_file() else "empty" if not log.bad_lines else "unreadable"
        rule = f"no step logged ({path}: {state})"
        fix = "pass a run directory runs/<name>/<timestamp> that logged at least one step (see `dhp runs`)"
    return ConfigError([ConfigIssue(path="RUN_DIR", value=str(run_dir), rule=rule, fix=fix)])


def _expert_load(rows: list[dict[str, Any]], module: str) -> str:
    """Median over steps of the worst MoE layer's max/mean tokens per expert, and the worst step."""
    loads = [(r["step"], r["expert_load"][module]) for r in rows if module in r["expert_load"]]
    step, worst = max(loads, key=lambda s_l: s_l[1]["max_over_mean"])
    med = statistics.median(v["max_over_mean"] for _, v in loads)
    return (
        f"{med:.2f} ({worst['max_over_mean']:.2f} at step {step}, layer {worst['worst_layer']}: "
        f"{worst['tokens_per_expert_max']:.0f} / {worst['tokens_per_expert_mean']:.1f} tokens)"
    )


def _time_split(plt, rows: list[dict[str, Any]], x: list[int], mods: list[str], finish) -> None:
    """Per step, one stacked bar per module: fwd / bwd / optimizer step (and the LLM's wait)."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(mods)
    colours = {"fwd": "tab:blue", "bwd": "tab:orange", "step": "tab:green"}
    for j, m in enumerate(mods):  # one bar per module and step, side by side: modules overlap in time
        xs = [i - 0.4 + width * (j + 0.5) for i in x]
        bottom = [0.0] * len(rows)
        parts = [(p, [r[f"{m}_{p}_s"] for r in rows]) for p in PARTS]
        if m == mods[-1]:  # the consumer: records list the modules producers first
            parts.append(("wait", [r["wait_s"] for r in rows]))
        for part, vals in parts:
            ax.bar(
                xs,
                vals,
                width=width * 0.95,
                bottom=bottom,
                color=colours.get(part, "lightgrey"),
                hatch="//" if j % 2 else None,
                edgecolor="white",
                label=f"{m} {part}",
            )
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.plot(x, [r["step_s"] for r in rows], "k.-", label="step wall time")
    finish(fig, ax, "time split", "s (max over a module's ranks)")


def render_report_summary(
    run_dir: Path, rows: list[dict[str, Any]], pngs: list[Path], *, console: Console
) -> None:
    """The summary table: steps, loss, throughput, MFU, time split, memory per rank, restarts and
    resumes (from the run's events), a failure, unreadable lines."""
    log = read_run_log(Path(run_dir) / "metrics.jsonl")
    marks = log.marks if log.records else find_restarts(rows)
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    table = Table(title=f"dhp report: {run_dir}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("steps logged", f"{len(rows)} (steps {rows[0]['step']}..{rows[-1]['step']})")
    table.add_row(
        "loss first -> last (min)",
        f"{rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} ({min(r['loss'] for r in rows):.4f})",
    )
    if log.evals:
        first, last = log.evals[0], log.evals[-1]
        best = min(log.evals, key=lambda e: e["eval_loss"])
        table.add_row(
            "eval loss first -> last (best)",
            f"{first['eval_loss']:.4f} -> {last['eval_loss']:.4f} ({best['eval_loss']:.4f} at step "
            f"{best['step']}; {len(log.evals)} evaluation(s) of {last['eval_samples']} samples)",
        )
    for key, label, fmt in (
        ("grad_norm", "grad norm (median)", "{:.3g}"),
        ("step_s", "step time (median)", "{:.3f} s"),
    ):
        if _has(rows, key):
            table.add_row(label, fmt.format(med(key)))
    for m in _modules(rows):
        split = " / ".join(f"{med(f'{m}_{p}_s'):.3f}" for p in PARTS)
        table.add_row(f"{m} fwd / bwd / step (median)", f"{split} s")
    if _has(rows, "wait_s"):
        table.add_row("LLM wait on hand-off (median)", f"{med('wait_s'):.3f} s")
    if _has(rows, "tokens_per_s_vision") and _has(rows, "tokens_per_s_text"):
        table.add_row(
            "vision / text tokens/s (median)",
            f"{med('tokens_per_s_vision'):.0f} / {med('tokens_per_s_text'):.0f}",
        )
    if _has(rows, "mfu"):
        table.add_row("MFU (median)", percent(med("mfu")))
    if _has(rows, "peak_mem_bytes"):
        for k in sorted({k for r in rows for k in r["peak_mem_bytes"]}):
            peak = max(r["peak_mem_bytes"][k] for r in rows if k in r["peak_mem_bytes"])
            table.add_row(f"peak memory {k}", f"{peak / 2**20:.0f} MiB")
    for name in sorted({k for r in rows for k in r["aux_losses"]} if _has(rows, "aux_losses") else ()):
        vals = [r["aux_losses"][name] for r in rows if name in r["aux_losses"]]
        table.add_row(f"{name} first -> last (unweighted)", f"{vals[0]:.4f} -> {vals[-1]:.4f}")
    for m in sorted({m for r in rows for m in r["expert_load"]} if _has(rows, "expert_load") else ()):
        table.add_row(f"{m} expert load max/mean (median; worst)", _expert_load(rows, m))
    table.add_row("restarts / resumes", "; ".join(r.why for r in marks) or "none")
    if log.failed is not None:
        table.add_row("failed", f"{log.failed.get('reason', '')} ({log.failed.get('traceback', '-')})")
    if log.bad_lines:
        table.add_row("unreadable lines", f"{log.bad_lines} (a write cut short by a kill)")
    if skipped := count_skipped(Path(run_dir)):
        table.add_row("bad samples skipped", f"{skipped}, named in {run_dir / 'bad_samples.jsonl'}")
    table.add_row("plots", f"{len(pngs)} PNGs in {pngs[0].parent}" if pngs else "none")
    console.print(table)
