"""The ``dhp`` command line. Each command parses its arguments and calls one library function.

Arguments look like Hydra's: ``dhp plan conf=qwen_vl_32b modules.vision.parallel.sp=4 --dry-run``.
``conf=`` picks a recipe (or a YAML path), ``smoke=true`` shrinks it to a tiny CPU run, and every
other ``key=value`` is a Hydra override. A user error (:class:`dhp.errors.DhpError`) prints a short
message and exits with status 2, never a traceback.

To add a command: a thin function decorated with ``@app.command()`` (or on a sub-typer added with
``app.add_typer(sub, name="data")``) that calls ``parse_hydra_args(command_words(ctx, words))``
and ``load_config``. Each command imports its library function inside its body, so ``dhp --help``
starts without loading torch or Ray.
"""

from __future__ import annotations

import json
import os
import sys

import typer
from rich.markup import escape

from dhp.completion import complete_word
from dhp.errors import DhpError
from dhp.term import make_console

HYDRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}
#: the key=value words of a command: shell completion of conf= recipe names (dhp.completion)
KEY_VALUES = typer.Argument(
    None,
    help="conf=RECIPE|PATH, smoke=true|false and key=value overrides.",
    autocompletion=complete_word,
    show_default=False,
    metavar="KEY=VALUE...",
)

app = typer.Typer(
    name="dhp",
    help="Train multimodal models with disaggregated hybrid parallelism (one Ray group per module).",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, powershell)
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: no "<bool>" type column beside flags
    context_settings={"max_content_width": 120},
)
console = make_console()  # off a terminal: a fixed wide width, nothing cut (dhp.term)
err_console = make_console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        from dhp import __version__

        print(f"dhp {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the dhp version and exit."
    ),
) -> None:
    """Train multimodal models with disaggregated hybrid parallelism (one Ray group per module)."""


def machine_profile(cfg):
    """``cfg`` with this machine's cluster numbers when it plans for this machine (dhp.machine)."""
    from dhp.machine import machine_profile as this_machine

    return this_machine(cfg)


def checked_config(conf: str, overrides: list[str], *, smoke: bool, worst_case: bool = False):
    """The run config after every check a run passes before any process starts, all problems in one
    ConfigError (dhp.runtime.launch.preflight): what `dhp plan` and `dhp train` both call. Lines that
    are not problems (the tiny checkpoint used, rows a skip policy skips) go to stderr.
    ``worst_case``: `dhp plan --worst-case` only."""
    from dhp.runtime.launch.preflight import checked_config as check

    return check(
        conf,
        overrides,
        smoke=smoke,
        say=lambda line: err_console.print(line, markup=False, soft_wrap=True),
        worst_case=worst_case,
    )


def refine_machine_profile(run_dir, cfg) -> None:
    """Fold a finished local run's phase times into this machine's profile cache (dhp.machine)."""
    from dhp.errors import DhpError
    from dhp.machine import record_run

    if run_dir is None:
        return
    try:
        line = record_run(run_dir, cfg)
    except DhpError as e:  # a run the fit cannot use leaves the cache as it was; say why
        err_console.print(f"machine profile not refined: {e}", markup=False, soft_wrap=True)
        return
    if line:
        console.print(f"estimates on this machine now use: {line}", markup=False, soft_wrap=True)


def command_words(ctx: typer.Context, words: list[str] | None) -> list[str]:
    """The key=value words of a command, in order: the declared argument's, then any extra ones."""
    return [*(words or []), *ctx.args]


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
    words: list[str] = KEY_VALUES,
    dry_run: bool = typer.Option(False, "--dry-run", help="Plan only; do not contact Ray."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON document."),
    auto: bool = typer.Option(
        False, "--auto", help="Search for the fastest plan that fits; keeps key=value settings."
    ),
    save: str = typer.Option(
        "",
        "--save",
        help="With --auto: write the chosen run as a recipe YAML, run name <name>_auto (unless name= is given).",
    ),
    worst_case: bool = typer.Option(
        False,
        "--worst-case",
        help="Fill every micro-batch to its seq_len and read no data row: plans a recipe without "
        "its model.path and data.path (dhp train still needs them).",
    ),
) -> None:
    """Compile a run's plan: groups, placement, routing, memory by phase and a step-time estimate.

    Usage: dhp plan conf=RECIPE|PATH key=value... smoke=true --dry-run --json (all but conf= optional).
    Without --dry-run the placement groups are also reserved on the Ray cluster, then released.
    --worst-case plans a recipe before you have its files (an SFT recipe's model.path and data.path):
    every micro-batch filled to its seq_len.
    """
    from dhp.plan import compile_plan, render_plan
    from dhp.plan.reserve import reserve_plan

    conf, overrides, smoke = parse_hydra_args(command_words(ctx, words))
    # every check dhp train makes before step 1 (the sampled rows' lengths time the step), then
    # this machine's numbers
    cfg = machine_profile(checked_config(conf, overrides, smoke=smoke, worst_case=worst_case))
    if auto:
        from dhp.plan.auto import render_auto, run_auto

        compiled, ranked, why = run_auto(
            cfg, {o.partition("=")[0] for o in overrides}, save=save or None, worst_case=worst_case
        )
        if not as_json:
            render_auto(ranked, why, compiled, console)
        if save:  # stderr under --json: stdout stays one JSON document
            out = err_console if as_json else console
            out.print(
                f"saved the winning plan as run name {compiled.name!r}: {os.path.abspath(save)}\n"
                f"  train it with: dhp train conf={save}",
                markup=False,
                soft_wrap=True,
            )
    else:
        compiled = compile_plan(cfg)
    if not dry_run:
        reserve_plan(compiled, cluster=cfg.cluster)
    if as_json:
        print(compiled.to_json_str())
    elif not auto:
        render_plan(compiled, console=console, reserved=not dry_run)


@app.command()
def calibrate(
    run_dirs: list[str] = typer.Argument(..., help="Run dirs (runs/<name>/<timestamp>), one cluster."),  # noqa: B008
    out: str = typer.Option(..., "--out", help="Profile YAML to write, e.g. conf/cluster/my_cluster.yaml."),
    prior_weight: float = typer.Option(
        None,
        "--prior-weight",
        min=0.0,
        help="How much the runs' own cluster profile anchors each coefficient (0: the runs alone). "
        "Default: dhp.plan.calibrate.PRIOR_WEIGHT.",
    ),
) -> None:
    """Fit the step-time model's efficiencies to measured runs and write a cluster profile.

    Reads each run's config.yaml and metrics.jsonl (per-module fwd/bwd/step seconds), fits the
    matmul/attention/communication/memory efficiencies and overheads by least squares, each
    anchored to the runs' own profile where the runs cannot tell two terms apart, and writes a
    cluster profile. Saved as conf/cluster/NAME.yaml, ``cluster=NAME`` uses it; `dhp plan`
    prints the profile its estimate used.
    """
    from dhp.plan.calibrate import PRIOR_WEIGHT
    from dhp.plan.calibrate import calibrate as fit_profile

    weight = PRIOR_WEIGHT if prior_weight is None else prior_weight
    report = fit_profile(run_dirs, out=out, prior_weight=weight)
    prof = report["profile"]
    console.print(f"wrote [bold]{out}[/] ({prof['profile']})")
    for key in (
        "matmul_efficiency",
        "attention_efficiency",
        "comm_efficiency",
        "memory_efficiency",
        "call_overhead_s",
        "dispatch_overhead_s",
    ):
        console.print(f"  {key}: {prof[key]:.4g}")
    for o in report["observations"]:
        console.print(f"  {o['observation']}: measured {o['measured_s']:.4f} s, fitted {o['fitted_s']:.4f} s")


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
def train(
    ctx: typer.Context,
    words: list[str] = KEY_VALUES,
    multirun: bool = typer.Option(
        False, "-m", "--multirun", help="Sweep: key=a,b runs one training per combination, in turn."
    ),
) -> None:
    """Train a recipe: one Ray actor group per module, the driver step, metrics and checkpoints.

    Usage: dhp train conf=RECIPE|PATH [smoke=true] [key=value ...]. Writes
    <train.output_dir>/<name>/<timestamp>/ (config.yaml, plan.json, metrics.jsonl, checkpoints/).
    train.resume=auto continues the newest checkpoint of this run name. Ctrl-C saves a checkpoint
    when train.save_on_interrupt and exits 130. With -m (Hydra multirun), e.g.
    dhp train conf=tiny_vlm -m train.lr=1e-3,2e-3 train.steps=2: one run per combination, then a
    summary table and <train.output_dir>/sweeps/<timestamp>/sweep.jsonl; exits 1 if a run failed.
    """
    from dhp.runtime.launch.forkserver import for_driver

    conf, overrides, smoke = parse_hydra_args(command_words(ctx, words))
    if multirun:
        with for_driver():  # every member's ranks fork from one server (each member's family on use)
            from dhp.runtime.loop.sweep import run_sweep, sweep_exit_code

            raise typer.Exit(sweep_exit_code(run_sweep(conf, overrides, smoke=smoke, console=console)))
    # every problem of the config, the model directory and the sampled data ends here, at once,
    # before any process starts (the checks dhp plan makes)
    cfg = checked_config(conf, overrides, smoke=smoke)
    # the rank processes' imports start now, on another core, beside this process's own
    with for_driver(family=cfg.model.family, ray_address=cfg.cluster.ray_address):
        from dhp.runtime.loop.interrupts import RunInterrupted
        from dhp.runtime.loop.train import train as run_training

        cfg = machine_profile(cfg)  # this machine's numbers
        try:
            result = run_training(cfg, console=console)
        except RunInterrupted as stop:  # Ctrl-C: stopped at a step boundary, saved, torn down
            result = stop.result
    refine_machine_profile(result.run_dir, cfg)
    if result.interrupted:  # 128 + the signal: 130 for Ctrl-C, 143 for SIGTERM
        from dhp.runtime.loop.supervisor import exit_code

        raise typer.Exit(exit_code(result.signal))
    raise typer.Exit(0)


@app.command(context_settings=HYDRA_ARGS)
def verify(
    ctx: typer.Context,
    words: list[str] = KEY_VALUES,
    steps: int = typer.Option(10, "--steps", help="Optimizer steps to compare (also accepted as steps=N)."),
    loss_rtol: float = typer.Option(1e-5, "--loss-rtol", help="Max relative loss difference per step."),
    grad_atol: float = typer.Option(
        1e-4, "--grad-atol", help="Max absolute difference of any gradient element."
    ),
    param_atol: float = typer.Option(
        1e-4, "--param-atol", help="Max absolute difference of any parameter element after each update."
    ),
) -> None:
    """Run a plan and the unsplit single-process transformers model side by side; exit 1 beyond tolerance.

    Usage: dhp verify conf=RECIPE|PATH, then optional steps=N and key=value overrides. Same initial weights, batches,
    AdamW and LR schedule; prints per-step loss and grad-norm differences and the max gradient and
    parameter-after-update difference per module (tolerance: loss and grad norm 1e-5 relative, every
    gradient and parameter 1e-4 absolute; fp32 only).
    """
    from dhp.runtime.launch.forkserver import for_driver
    from dhp.validation import load_config

    given = command_words(ctx, words)
    args = [a for a in given if not a.startswith("steps=")]
    steps = next((int(a.partition("=")[2]) for a in given if a.startswith("steps=")), steps)
    conf, overrides, smoke = parse_hydra_args(args)
    cfg = load_config(conf, overrides, smoke=smoke)
    # the ranks' imports start beside this process's own
    with for_driver(family=cfg.model.family, ray_address=cfg.cluster.ray_address):
        from dhp.models.tiny_cache import ensure_tiny_checkpoint
        from dhp.runtime.verify.compare import render_report, render_step, verify_plan

        ensure_tiny_checkpoint(cfg.model, say=lambda line: console.print(escape(line)))
        report = verify_plan(
            cfg,
            steps=steps,
            loss_rtol=loss_rtol,
            grad_atol=grad_atol,
            param_atol=param_atol,
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
    lora: str = typer.Option(
        "",
        "--lora",
        help="LoRA adapters: merge | adapter (peft files beside the base; default: export.lora).",
    ),
    adapter_base: str = typer.Option(
        "",
        "--adapter-base",
        help="With adapter export: base_model_name_or_path in adapter_config.json (a hub id or a "
        "path; default: OUT's absolute path, which breaks once OUT moves).",
    ),
) -> None:
    """Export a dhp checkpoint to a Hugging Face directory (config.json + safetensors shards).

    The result loads with the model family's transformers class (named in the written config.json's
    ``architectures`` and printed here). The model architecture is read from the run's
    ``config.yaml`` next to ``checkpoints/``.
    """
    from dhp.checkpoint.export import export_checkpoint
    from dhp.metrics.bars import progress_bar

    with progress_bar(err_console, "export shards") as bar:
        ckpt, path = export_checkpoint(
            checkpoint,
            out_dir=out,
            dtype=dtype or None,
            on_progress=bar,
            lora_mode=lora or None,
            adapter_base=adapter_base or None,
            say=lambda line: err_console.print(escape(line)),
        )
    console.print(f"exported {ckpt} -> [bold]{path}[/]")
    classes = json.loads((path / "config.json").read_text())["architectures"]
    console.print(f"load it with transformers' {classes[0]}.from_pretrained({str(path)!r})")


ckpt_app = typer.Typer(help="Inspect checkpoints.", no_args_is_help=True)
app.add_typer(ckpt_app, name="checkpoint")


@ckpt_app.command("verify")
def checkpoint_verify(
    path: str = typer.Argument(..., help="A step_XXXXXX dir, a run dir or its checkpoints/."),
) -> None:
    """Check every file of a checkpoint against its manifest checksums; exit 1 when one fails."""
    from dhp.checkpoint.manifest import verify_many

    ok = verify_many(path, console=console)
    raise typer.Exit(0 if ok else 1)


@app.command()
def runs(
    root: str = typer.Argument("runs", help="The train.output_dir to scan (default: runs)."),
) -> None:
    """List the runs under ROOT: status, steps, last loss, checkpoints and trackers.

    Status: finished (checkpoint at the run's last step), active (metrics written in the last 2
    minutes), failed (the reason and traceback.txt in the note), stopped (resume it with
    train.resume=auto) or empty (no step logged).
    """
    from pathlib import Path

    from dhp.metrics.runs import list_runs, render_runs

    render_runs(list_runs(Path(root)), console=console, root=Path(root))


@app.command()
def report(
    run_dir: str = typer.Argument(..., help="A run directory runs/<name>/<timestamp>."),
    out: str = typer.Option("", "--out", help="Where the PNGs go (default: RUN_DIR/report)."),
) -> None:
    """Plot one run (loss, grad norm, LR, tokens/s, time split, peak memory per rank) and summarise it.

    Writes one PNG per plot; restarts recorded in metrics.jsonl are marked on every step plot.
    Needs matplotlib (pip install -e '.[plots]').
    """
    from pathlib import Path

    from dhp.metrics.report import render_report_summary, write_report

    pngs, rows = write_report(Path(run_dir), out_dir=Path(out) if out else None)
    render_report_summary(Path(run_dir), rows, pngs, console=console)


data_app = typer.Typer(help="Inspect the configured datasets without training.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("check", context_settings=HYDRA_ARGS)
def data_check(
    ctx: typer.Context,
    words: list[str] = KEY_VALUES,
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
    show: int = typer.Option(
        0, "--show", help="Print the first N samples decoded: roles, media, loss tokens."
    ),
) -> None:
    """Scan every configured sample once: counts, vision tokens, text lengths, bad samples.

    Usage: dhp data check conf=RECIPE|PATH [key=value ...] [--json] [--show N]. Without conf=,
    `dhp data check data.path=FILE` runs the checks that need no tokenizer (records, media, counts).
    Exits 1 when a sample is bad and data.on_bad_sample=raise (a run would stop there).
    """
    from dhp.data.check import check_data, render_report
    from dhp.validation import load_config

    if not any(a.startswith("conf=") for a in command_words(ctx, words)):
        from dhp.config.data_shortcuts import bare_data_config
        from dhp.data.check_records import check_records

        report = check_records(bare_data_config(command_words(ctx, words)))
        if as_json:
            print(json.dumps(report.to_json(), indent=1))
        else:
            render_report(report, console=console)
        raise typer.Exit(1 if report.failed else 0)
    conf, overrides, smoke = parse_hydra_args(command_words(ctx, words))
    cfg = load_config(conf, overrides, smoke=smoke)
    from dhp.metrics.bars import progress_bar
    from dhp.models.graph import module_seq_lens, seq_limits
    from dhp.models.tiny_cache import ensure_tiny_checkpoint

    ensure_tiny_checkpoint(cfg.model, say=lambda line: err_console.print(escape(line)))  # stdout: --json
    patches, tokens = seq_limits(cfg.model.family, cfg.modules)

    with progress_bar(err_console, "data check") as bar:  # stderr: --json output stays clean
        report = check_data(
            data=cfg.data,
            model=cfg.model,
            patch_seq_len=patches,
            token_seq_len=tokens,
            seed=cfg.train.seed,
            on_progress=bar,
            show=show,
            seq_lens=module_seq_lens(cfg.modules),
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


def _early_signals() -> None:
    """SIGTERM before a command installs its own handling (``dhp train`` does) exits 143 quietly."""
    import signal

    def term(signum, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, term)


def main() -> None:
    """Console entry point: run the app; a DhpError prints a short message and exits with status 1
    for a runtime failure (RuntimeFailure), 2 for config, data, plan and checkpoint errors."""
    from dhp.errors import RuntimeFailure

    _early_signals()
    try:
        app()
    except KeyboardInterrupt:  # Ctrl-C before a run's own handling (imports, config, planning)
        sys.exit(130)
    except DhpError as err:
        print_error(err)
        sys.exit(1 if isinstance(err, RuntimeFailure) else 2)
    except Exception as err:  # a bug of dhp's own: one line, the traceback only when asked for
        if os.environ.get("DHP_DEBUG"):
            raise
        notes = "".join(f"{n}\n" for n in getattr(err, "__notes__", []))  # a run's traceback file
        err_console.print(
            f"internal error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}\n{notes}"
            "This is a bug in dhp. Run again with DHP_DEBUG=1 for the traceback and report it.",
            markup=False,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
