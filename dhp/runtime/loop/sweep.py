"""``dhp train -m``: a Hydra-style multirun. Each combination of the swept values is one ordinary
``dhp train`` run (its own run directory), run one after the other in this process; one Ray is
shared by all members when dhp starts it locally. A member that fails is recorded with its error
and the sweep goes on. At the end: a summary table and ``<train.output_dir>/sweeps/<timestamp>/
sweep.jsonl`` (one line per member: overrides, status, run dir, final loss, tokens/s, peak memory).

Sweep syntax is Hydra's: ``key=a,b`` (a list of values), ``key=range(1,4)``, ``key=choice(a,b)``;
``key=[a,b]`` stays one list value. Several swept keys give their cartesian product, in the order
written (the last key varies fastest), as Hydra's basic sweeper does.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from rich.console import Console
from rich.table import Table

from dhp.errors import ConfigError, ConfigIssue, DhpError
from dhp.metrics.rundir import read_run_log
from dhp.plan import compile_plan
from dhp.runtime.loop.driver import connect_ray
from dhp.runtime.loop.interrupts import RunInterrupted
from dhp.runtime.loop.train import train
from dhp.validation import load_config


@dataclass
class SweepMember:
    """One run of a sweep and what it produced (``status``: ok | failed | interrupted)."""

    index: int
    overrides: list[str]
    status: str = "pending"
    run_dir: str | None = None
    steps: int = 0
    final_loss: float | None = None
    tokens_per_s_vision: float | None = None  # median over the run's logged steps
    tokens_per_s_text: float | None = None
    peak_mem_bytes: int | None = None  # max over steps and ranks
    error: str | None = None
    seconds: float = 0.0
    swept: dict[str, str] = field(default_factory=dict)


def expand_sweep(overrides: list[str]) -> list[tuple[dict[str, str], list[str]]]:
    """Every combination of the swept overrides: ``(swept key -> value, full override list)``.

    Raises ConfigError when an override does not parse, or when nothing is swept."""

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(
            [ConfigIssue("-m", overrides, f"not a valid override: {e}", "write key=a,b or key=range(1,4)")]
        ) from e
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    swept = [o for o in parsed if o.is_sweep_override()]
    if not swept:
        raise ConfigError(
            [
                ConfigIssue(
                    "-m",
                    overrides,
                    "a multirun needs at least one swept key",
                    "write e.g. train.lr=1e-3,2e-3 (comma-separated values), or drop -m",
                )
            ]
        )
    keys = [o.get_key_element() for o in swept]
    values = [list(o.sweep_string_iterator()) for o in swept]
    return [
        (dict(zip(keys, combo, strict=True)), fixed + [f"{k}={v}" for k, v in zip(keys, combo, strict=True)])
        for combo in itertools.product(*values)
    ]


def run_sweep(conf: str, overrides: list[str], *, smoke: bool, console: Console) -> list[SweepMember]:
    """Run every member of the sweep; write ``sweep.jsonl`` and print the summary table."""

    combos = expand_sweep(overrides)
    members = [SweepMember(index=i, overrides=ov, swept=sw) for i, (sw, ov) in enumerate(combos)]
    first = load_config(conf, combos[0][1], smoke=smoke)  # where the sweep file goes
    out = _sweep_dir(first.train.output_dir)
    console.print(f"[bold]dhp train -m[/]: {len(members)} runs, summary in {out / 'sweep.jsonl'}")
    owns_ray = _start_shared_ray(conf, combos, smoke=smoke)
    interrupt = None
    try:
        for m in members:
            console.rule(
                f"sweep run {m.index + 1}/{len(members)}: {' '.join(f'{k}={v}' for k, v in m.swept.items())}"
            )
            interrupt = _run_member(m, conf=conf, smoke=smoke, console=console)
            with (out / "sweep.jsonl").open("a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(m), sort_keys=True) + "\n")
            if m.status == "interrupted":
                break
    finally:
        if owns_ray and ray.is_initialized():
            ray.shutdown()
    render_sweep(members, console=console, path=out / "sweep.jsonl")
    if interrupt is not None:  # the caller's Ctrl-C, after the summary (dhp.runtime.loop.interrupts)
        raise interrupt
    return members


def _sweep_dir(output_dir: str) -> Path:
    base = Path(output_dir) / "sweeps" / time.strftime("%Y%m%d-%H%M%S")
    out, i = base, 1
    while out.exists():
        out, i = base.with_name(f"{base.name}-{i}"), i + 1
    out.mkdir(parents=True)
    return out


def _start_shared_ray(conf: str, combos: list, *, smoke: bool) -> bool:
    """One local Ray for every member, sized to the member needing the most CPU slots. Nothing is
    started when a cluster address is configured (each member joins it) or no member config is valid
    (each member then reports its own error)."""

    best = None
    for _, ov in combos:
        try:
            cfg = load_config(conf, ov, smoke=smoke)
            plan = compile_plan(cfg)
        except DhpError:
            continue
        need = sum(b["CPU"] for pg in plan.placement_groups for b in pg.bundles)
        if best is None or need > best[0]:
            best = (need, cfg, plan)
    if best is None or best[1].cluster.ray_address:
        return False
    return connect_ray(cluster=best[1].cluster, plan=best[2])


def _run_member(m: SweepMember, *, conf: str, smoke: bool, console: Console) -> RunInterrupted | None:
    """Train one member, recording its outcome in ``m``; the RunInterrupted of a Ctrl-C (if any),
    which the sweep raises again once its summary is written."""
    t0 = time.monotonic()
    interrupt = None
    try:
        result = train(load_config(conf, m.overrides, smoke=smoke), console=console)
    except RunInterrupted as stop:  # Ctrl-C under Python's default handling: the sweep ends after it
        m.status, m.run_dir = "interrupted", str(stop.result.run_dir)
        _fill_metrics(m, Path(stop.result.run_dir) / "metrics.jsonl")
        interrupt = stop
    except DhpError as e:  # a user-fixable failure of this member: record it, go on
        m.status, m.error = "failed", f"{type(e).__name__}: {e}"
    except Exception as e:  # a bug in one member must not lose the others' results
        m.status, m.error = "failed", f"{type(e).__name__}: {e}"
    else:
        m.status = "interrupted" if result.interrupted else "ok"
        m.run_dir = str(result.run_dir)
        _fill_metrics(m, Path(result.run_dir) / "metrics.jsonl")
    m.seconds = time.monotonic() - t0
    if m.error:
        console.print(f"[red]sweep run {m.index + 1} failed[/]: {m.error.splitlines()[0]}")
    return interrupt


def _fill_metrics(m: SweepMember, path: Path) -> None:
    rows = read_run_log(path).records  # step records only: not the restart/resume/failed events
    if not rows:
        return
    m.steps = rows[-1]["step"]
    m.final_loss = rows[-1]["loss"]
    m.tokens_per_s_vision = statistics.median(r["tokens_per_s_vision"] for r in rows)
    m.tokens_per_s_text = statistics.median(r["tokens_per_s_text"] for r in rows)
    m.peak_mem_bytes = max(v for r in rows for v in r["peak_mem_bytes"].values())


def render_sweep(members: list[SweepMember], *, console: Console, path: Path) -> None:
    """The summary: one row per member with its swept values and results (errors in sweep.jsonl)."""
    keys = list(members[0].swept) if members else []
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    rows = [
        [
            str(m.index + 1),
            *(m.swept[k] for k in keys),
            m.status,
            str(m.steps),
            fmt(m.final_loss, ".4f"),
            fmt(m.tokens_per_s_vision, ".0f"),
            fmt(m.tokens_per_s_text, ".0f"),
            fmt(None if m.peak_mem_bytes is None else m.peak_mem_bytes / 2**20, ".0f"),
            "/".join(Path(m.run_dir).parts[-2:]) if m.run_dir else "-",  # <name>/<timestamp>
        ]
        for m in members
    ]
    table = Table(title=f"sweep summary ({path})")
    cols = ("#", *keys, "status", "steps", "final loss", "vis tok/s", "txt tok/s", "peak MiB", "run dir")
    for c, col in enumerate(cols):
        width = max(len(r[c]) for r in rows) if rows and col != "run dir" else None  # values never cut
        table.add_column(col, justify="left" if col in ("status", "run dir") else "right", min_width=width)
    for m, row in zip(members, rows, strict=True):
        table.add_row(*row, style="red" if m.status == "failed" else None)
    console.print(table)
    for m in members:
        if m.error:
            console.print(f"[red]run {m.index + 1} failed[/]: {m.error.splitlines()[0]}")


def sweep_exit_code(members: list[SweepMember]) -> int:
    """0 when every member finished, 130 when interrupted, else 1."""
    if any(m.status == "interrupted" for m in members):
        return 130
    return 0 if all(m.status == "ok" for m in members) else 1


__all__ = ["SweepMember", "expand_sweep", "render_sweep", "run_sweep", "sweep_exit_code"]
