"""The ``dhp`` command line. Each command parses its arguments and calls one library function.

Arguments look like Hydra's: ``dhp plan conf=qwen_vl_32b modules.vision.parallel.sp=4 --dry-run``.
``conf=`` picks a recipe (or a YAML path), ``smoke=true`` shrinks it to a tiny CPU run, and every
other ``key=value`` is a Hydra override. A user error (:class:`dhp.errors.DhpError`) prints a short
message and exits with status 2, never a traceback.

To add a command: a thin function decorated with ``@app.command()`` (or on a sub-typer added with
``app.add_typer(sub, name="data")``) that calls ``parse_hydra_args(ctx.args)`` and ``load_config``.
"""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console

from dhp.errors import DhpError

HYDRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}

app = typer.Typer(
    name="dhp",
    help="Train multimodal models with disaggregated hybrid parallelism (one Ray group per module).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)


def parse_hydra_args(args: list[str]) -> tuple[str, list[str], bool]:
    """Split ``conf=NAME``, ``smoke=true|false`` and the Hydra overrides out of the extra args.

    Raises ConfigError when ``conf=`` is missing or an argument is not ``key=value``.
    """
    from dhp.errors import ConfigError, ConfigIssue

    conf, smoke, overrides, bad, bad_smoke = "", False, [], [], []
    for arg in args:
        key, eq, value = arg.partition("=")
        if key == "conf":
            conf = value
        elif key == "smoke" and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            smoke = value.lower() in ("1", "true", "yes")
        elif key == "smoke":  # a typo such as smoke=ture must not silently mean false
            bad_smoke.append(value)
        elif (eq and key) or arg.startswith("~"):  # ~key deletes, as in Hydra
            overrides.append(arg)
        else:
            bad.append(arg)
    issues = [
        ConfigIssue(
            path=arg,
            value=arg,
            rule="not a key=value override or a known option",
            fix="write overrides as key=value; see `dhp plan --help`",
        )
        for arg in bad
    ]
    issues += [
        ConfigIssue(
            path="smoke", value=v, rule="must be true or false", fix="write smoke=true or smoke=false"
        )
        for v in bad_smoke
    ]
    if not conf:
        issues.append(
            ConfigIssue(
                path="conf",
                value=None,
                rule="conf= is required",
                fix="pass conf=RECIPE (see `dhp recipes`) or conf=path/to/run.yaml",
            )
        )
    if issues:
        raise ConfigError(issues)
    return conf, overrides, smoke


@app.command(context_settings=HYDRA_ARGS)
def plan(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, "--dry-run", help="Plan only; do not contact Ray."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON document."),
) -> None:
    """Compile a run's plan: groups, placement, routing and per-rank memory.

    Usage: dhp plan conf=RECIPE|PATH key=value... smoke=true --dry-run --json (all but conf= optional).
    Without --dry-run the placement groups are also reserved on the Ray cluster, then released.
    """
    from dhp.config import load_config
    from dhp.plan import compile_plan, render_plan
    from dhp.plan.reserve import reserve_plan

    conf, overrides, smoke = parse_hydra_args(ctx.args)
    cfg = load_config(conf, overrides, smoke=smoke)
    compiled = compile_plan(cfg)
    if dry_run:  # the data must be reachable where the run starts
        from dhp.data.preflight import check_data_paths

        check_data_paths(cfg.data)
    else:
        reserve_plan(compiled, cluster=cfg.cluster)
    if as_json:
        print(compiled.to_json_str())
    else:
        render_plan(compiled, console=console, reserved=not dry_run)


@app.command()
def recipes() -> None:
    """List the ready-made recipes in recipes/ with a one-line description each."""
    from rich.table import Table

    from dhp.config import list_recipes

    table = Table(title="recipes (use: dhp plan conf=NAME)")
    table.add_column("name", style="bold")
    table.add_column("description")
    for name, desc in list_recipes():
        table.add_row(name, desc)
    console.print(table)


@app.command(context_settings=HYDRA_ARGS)
def train(ctx: typer.Context) -> None:
    """Train a recipe: one Ray actor group per module, the driver step, metrics and checkpoints.

    Usage: dhp train conf=RECIPE|PATH [smoke=true] [key=value ...]. Writes
    <train.output_dir>/<name>/<timestamp>/ (config.yaml, plan.json, metrics.jsonl, checkpoints/).
    train.resume=auto continues the newest checkpoint of this run name. Ctrl-C saves a checkpoint
    when train.save_on_interrupt and exits 130.
    """
    from dhp.config import load_config
    from dhp.runtime.train import train as run_training

    conf, overrides, smoke = parse_hydra_args(ctx.args)
    result = run_training(load_config(conf, overrides, smoke=smoke), console=console)
    raise typer.Exit(130 if result.interrupted else 0)


@app.command(context_settings=HYDRA_ARGS)
def verify(
    ctx: typer.Context,
    steps: int = typer.Option(10, "--steps", help="Optimizer steps to compare (also accepted as steps=N)."),
    loss_rtol: float = typer.Option(1e-5, "--loss-rtol", help="Max relative loss difference per step."),
    grad_atol: float = typer.Option(
        1e-4, "--grad-atol", help="Max absolute difference of any gradient element."
    ),
) -> None:
    """Run a plan and the unsplit single-process transformers model side by side; exit 1 beyond tolerance.

    Usage: dhp verify conf=RECIPE|PATH, then optional steps=N and key=value overrides. Same initial weights, batches,
    AdamW and LR schedule; prints per-step loss differences and the max gradient difference per
    module (tolerance: loss 1e-5 relative, every gradient 1e-4 absolute; fp32 only).
    """
    from dhp.config import load_config
    from dhp.runtime.verify import render_report, render_step, verify_plan

    args = [a for a in ctx.args if not a.startswith("steps=")]
    steps = next((int(a.partition("=")[2]) for a in ctx.args if a.startswith("steps=")), steps)
    conf, overrides, smoke = parse_hydra_args(args)
    cfg = load_config(conf, overrides, smoke=smoke)
    report = verify_plan(
        cfg,
        steps=steps,
        loss_rtol=loss_rtol,
        grad_atol=grad_atol,
        on_step=lambda s, rep: render_step(s, rep, console=console),
    )
    render_report(report, console=console)
    raise typer.Exit(0 if report.passed else 1)


@app.command()
def export(
    checkpoint: str = typer.Argument(
        ..., help="A step_XXXXXX checkpoint directory (or a run dir: its newest)."
    ),
    out: str = typer.Argument(..., help="Output HF model directory."),
    dtype: str = typer.Option("", "--dtype", help="Cast weights: float32 | bfloat16 (default: as saved)."),
) -> None:
    """Export a dhp checkpoint to a Hugging Face directory (config.json + safetensors shards).

    The result loads with ``Qwen2_5_VLForConditionalGeneration.from_pretrained(out)``. The model
    architecture is read from the run's ``config.yaml`` next to ``checkpoints/``.
    """
    from dhp.checkpoint.export import export_checkpoint

    ckpt, path = export_checkpoint(checkpoint, out_dir=out, dtype=dtype or None)
    console.print(f"exported {ckpt} -> [bold]{path}[/]")


data_app = typer.Typer(help="Inspect the configured datasets without training.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("check", context_settings=HYDRA_ARGS)
def data_check(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
) -> None:
    """Scan every configured sample once: counts, vision tokens, text lengths, bad samples.

    Usage: dhp data check conf=RECIPE|PATH [key=value ...] [--json]. Exits 1 when a sample is bad
    and data.on_bad_sample=raise (a run would stop there).
    """
    from dhp.config import load_config
    from dhp.data.check import check_data, render_report

    conf, overrides, smoke = parse_hydra_args(ctx.args)
    cfg = load_config(conf, overrides, smoke=smoke)
    report = check_data(
        data=cfg.data,
        model=cfg.model,
        vision_seq_len=cfg.modules["vision"].seq_len if "vision" in cfg.modules else 0,
        llm_seq_len=cfg.modules["llm"].seq_len,
        seed=cfg.train.seed,
    )
    if as_json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        render_report(report, console=console)
    raise typer.Exit(1 if report.failed else 0)


MAX_ISSUES_SHOWN = 15  # keeps a ConfigError on one screen


def error_text(err: DhpError) -> str:
    """The message of ``err``; a ConfigError with many issues shows the first MAX_ISSUES_SHOWN."""
    from dhp.errors import ConfigError

    if not isinstance(err, ConfigError) or len(err.issues) <= MAX_ISSUES_SHOWN:
        return str(err)
    lines = [f"{len(err.issues)} config error(s), the first {MAX_ISSUES_SHOWN}:"]
    lines += [f"  - {i}" for i in err.issues[:MAX_ISSUES_SHOWN]]
    lines.append(f"  ... and {len(err.issues) - MAX_ISSUES_SHOWN} more; fix these and run again")
    return "\n".join(lines)


def print_error(err: DhpError) -> None:
    """Print a user error as one short screen: its type and the message (no traceback, no markup)."""
    from rich.panel import Panel
    from rich.text import Text

    title = type(err).__name__
    err_console.print(
        Panel(Text(error_text(err)), title=f"[bold red]{title}", border_style="red", expand=False)
    )


def main() -> None:
    """Console entry point: run the app; a DhpError exits with status 2 and a short message."""
    try:
        app()
    except DhpError as err:
        print_error(err)
        sys.exit(2)


if __name__ == "__main__":
    main()
