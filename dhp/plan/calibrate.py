"""``dhp calibrate``: fit the step-time model's efficiencies to measured runs.

For every run directory (``config.yaml`` + ``metrics.jsonl``), each module gives three
observations per step: ``<m>_fwd_s`` and ``<m>_bwd_s`` (summed over the step's micro-batches, max
over ranks) and ``<m>_step_s`` (clip + AdamW). The model predicts each as FEATURES . x
(``dhp.plan.estimate``: seconds at efficiency 1 of matmul, attention, communication and memory
traffic, and a count of calls), where x = (1/matmul_eff, 1/attention_eff, 1/comm_eff,
1/memory_eff, call_overhead_s). The fit minimises the squared RELATIVE error over all observations
(each row divided by its measurement), with x >= 0: a coefficient the runs cannot determine (its
feature is zero everywhere, or the unconstrained fit makes it negative) keeps the profile's prior
value. Every coefficient is also anchored to its prior (``PRIOR_WEIGHT``): with eleven coefficients
and a handful of runs, features that grow together (attention FLOPs and attention calls both grow
with the image) leave the split between them undetermined, and an unanchored fit trades one for the
other (an attention 27x faster than peak, paid back by 7x the per-call overhead), which predicts a
new plan badly. ``dispatch_overhead_s`` is what the measured ``step_s`` has beyond the modelled schedule: one more observation per run, the whole ``step_s`` against
the schedule's features (``step_row``) plus a dispatch per micro-batch. Measurements: the median over logged steps, the first one
(warm-up) dropped when there are more.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from dhp.config.placement import sets_among
from dhp.errors import ConfigError, ConfigIssue
from dhp.plan.estimate import (
    FEATURES,
    OVERHEAD_KEYS,
    busy_processes,
    coefficients,
    module_features,
    producer_tokens_per_rank,
    seconds,
    timing_shapes,
)
from dhp.plan.graph import ModuleGraph, run_graph

# A run's whole step_s weighs as much as its module phases together (5 of them in a VLM step).
STEP_WEIGHT = 5.0
# Huber loss on the relative residuals: quadratic within 20 %, linear beyond (a loaded box makes
# single measurements jump by 2x); a few reweighted rounds of the non-negative fit.
HUBER_DELTA = 0.2
HUBER_ROUNDS = 6
# The prior profile's coefficient counts as one more observation of it, x_k / prior_k = 1, at this
# weight (a module phase weighs 1, a run's step STEP_WEIGHT): where the runs determine a coefficient
# they move it, where they cannot tell two terms apart the profile's physical estimate decides.
# Chosen on the planner bench's held-out step times (4 runs, each calibration half, 32 predictions
# within 25 %): weight 0 (no anchor) 25, 1 30, 2 31, 3 25, with conf/cluster/local_cpu.yaml's prior.
PRIOR_WEIGHT = 2.0
PROFILE_KEYS = {
    "matmul": "matmul_efficiency",
    "attention": "attention_efficiency",
    "comm": "comm_efficiency",
    "memory": "memory_efficiency",
}


def _bad(path: str, rule: str, fix: str) -> ConfigError:
    return ConfigError([ConfigIssue(path=path, value=path, rule=rule, fix=fix)])


def load_run(run_dir: str | Path) -> tuple[DictConfig, list[dict]]:
    """The run's config and its metric records; ConfigError when the directory is not a run."""
    from dhp.validation import load_config

    d = Path(run_dir)
    cfg_path, metrics = d / "config.yaml", d / "metrics.jsonl"
    if not cfg_path.is_file() or not metrics.is_file():
        raise _bad(
            str(d),
            "not a run directory (needs config.yaml and metrics.jsonl)",
            "pass runs/<name>/<timestamp> directories written by dhp train",
        )
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "event" not in r]  # step records, not restart/resume/failed events
    if not rows:
        raise _bad(str(metrics), "has no records", "train at least one logged step")
    return load_config(str(cfg_path), []), rows


def measured(rows: list[dict], key: str) -> float:
    """Median of ``key`` over the records, without the first (warm-up) when there are more."""
    use = rows[1:] if len(rows) > 1 else rows
    return float(statistics.median(r[key] for r in use))


def run_observations(config: DictConfig, rows: list[dict]) -> list[tuple[dict[str, float], float, str]]:
    """(features, measured seconds, label) rows of one run (see the module docstring)."""
    from dhp.plan.compile import micro_batches_per_step, module_shapes

    shapes = module_shapes(config)
    graph = run_graph(config)
    replicas = shapes[graph.consumer].layout.num_replicas
    n_mb = micro_batches_per_step(config.train, replicas)
    out = []
    per: dict[str, tuple] = {}
    # the shapes the estimate times (the run's measured data lengths, when its config has them)
    for name, shape in timing_shapes(config, shapes).items():
        world = shape.layout.world_size
        tokens = (
            producer_tokens_per_rank(config, shape, consumer_replicas=replicas)
            if name in graph.producers
            else shape.tokens
        )
        procs = busy_processes(sum(int(m.gpus) for m in config.modules.values()))
        f = module_features(shape, tokens, config.cluster, world, procs)
        per[name] = (f.fwd, f.bwd if shape.backward else {}, f.step if not shape.freeze else {})
        out.append(({k: n_mb * v for k, v in f.fwd.items()}, measured(rows, f"{name}_fwd_s"), f"{name}_fwd"))
        if shape.backward:
            out.append(
                ({k: n_mb * v for k, v in f.bwd.items()}, measured(rows, f"{name}_bwd_s"), f"{name}_bwd")
            )
        if not shape.freeze:
            step = {**dict.fromkeys(FEATURES, 0.0), **f.step}
            out.append((step, measured(rows, f"{name}_step_s"), f"{name}_step"))
    out.append(
        (
            step_row(config.placement, per, n_mb, coefficients(config.cluster), graph=graph),
            measured(rows, "step_s"),
            "step",
        )
    )
    return out


def _add(*rows: tuple[float, dict[str, float]]) -> dict[str, float]:
    out = dict.fromkeys(FEATURES, 0.0)
    for scale, row in rows:
        for k, v in row.items():
            out[k] += scale * v
    return out


def step_row(
    placement: str, per: dict[str, tuple], n_mb: int, prior: dict[str, float], *, graph: ModuleGraph
) -> dict[str, float]:
    """The whole step's features, linearised like ``dhp.plan.schedule``: one GPU-sharing set
    (collocated) sums every phase; several take the bottleneck stage (by the prior coefficients) n_mb
    times plus one micro-batch of the other stage and the longest finish, a set's stage and finish
    being its modules' in turn and the producers' stage the slowest producers-only set's (the sets
    run side by side; the consumer's set is the other stage). Plus n_mb dispatches."""
    stage = {n: _add((1.0, fwd), (1.0, bwd)) for n, (fwd, bwd, _) in per.items()}
    fin = {n: p[2] for n, p in per.items()}
    producers = [n for n in graph.producers if n in stage]
    sets = sets_among(placement, [*producers, graph.consumer])
    if len(sets) == 1 or not producers:
        row = _add(*((float(n_mb), s) for s in stage.values()), *((1.0, f) for f in fin.values()))
    else:
        load = {g: _add(*((1.0, stage[n]) for n in g)) for g in sets}
        done = {g: _add(*((1.0, fin[n]) for n in g)) for g in sets}
        home = next(g for g in sets if graph.consumer in g)
        apart = [g for g in sets if g is not home]
        pipe = [max(apart, key=lambda g: seconds(load[g], prior)), home]
        slow = max(pipe, key=lambda g: seconds(load[g], prior))
        fast = next(g for g in pipe if g is not slow)
        last = max(sets, key=lambda g: seconds(done[g], prior))  # the finishes run at once
        row = _add((float(n_mb), load[slow]), (1.0, load[fast]), (1.0, done[last]))
    row["dispatch"] = float(n_mb)
    return row


def nnls(a: np.ndarray, b: np.ndarray, sweeps: int = 5000) -> np.ndarray:
    """min ||a x - b||^2 subject to x >= 0, by cyclic coordinate descent (convex: converges;
    deterministic; a handful of unknowns)."""
    x = np.zeros(a.shape[1])
    norms = (a * a).sum(axis=0)
    r = a @ x - b
    for _ in range(sweeps):
        for j in range(a.shape[1]):
            if norms[j] == 0:
                continue
            new = max(0.0, x[j] - float(a[:, j] @ r) / norms[j])
            r += a[:, j] * (new - x[j])
            x[j] = new
    return x


def fit(
    obs: list[tuple[dict[str, float], float, str]],
    prior: dict[str, float],
    prior_weight: float = PRIOR_WEIGHT,
) -> dict[str, float]:
    """Non-negative robust least squares on relative errors (step rows weighted STEP_WEIGHT; Huber
    reweighting beyond HUBER_DELTA), each free coefficient anchored to ``prior`` at ``prior_weight``
    (0: the runs alone). A coefficient whose feature is zero in every observation keeps ``prior``;
    one the fit drives to 0 is floored at 1% of its prior (the runs say the term is negligible here;
    a zero would mean an infinite efficiency)."""
    free = [k for k in FEATURES if any(f.get(k, 0.0) > 0 for f, _, _ in obs)]
    fixed = {k: prior[k] for k in FEATURES if k not in free}
    rows = [(f, y, STEP_WEIGHT if label == "step" else 1.0) for f, y, label in obs if y > 0]
    if not free or not rows:
        return {**prior, **fixed}
    a = np.array([[f.get(k, 0.0) / y for k in free] for f, y, _ in rows])
    anchor = np.diag([1.0 / prior[k] if prior[k] > 0 else 0.0 for k in free])
    w = np.array([wt for _, _, wt in rows])
    robust = np.ones(len(rows))
    for _ in range(HUBER_ROUNDS):  # iteratively reweighted: a noisy outlier cannot drag the fit
        wt = np.concatenate([w * robust, np.full(len(free), prior_weight)])
        x = nnls(np.vstack([a, anchor]) * wt[:, None], wt)
        r = np.abs(a @ x - 1.0)  # relative residual of each observation
        robust = np.minimum(1.0, HUBER_DELTA / np.maximum(r, 1e-12)) ** 0.5
    return {**fixed, **{k: float(v) if v > 0 else 0.01 * prior[k] for k, v in zip(free, x, strict=True)}}


def calibrate(run_dirs: list[str], *, out: str, prior_weight: float = PRIOR_WEIGHT) -> dict:
    """Fit the profile on ``run_dirs`` and write it to ``out`` (a cluster YAML); returns a report.
    The runs' own cluster profile is the prior each coefficient is anchored to (``fit``)."""
    runs = [load_run(d) for d in run_dirs]
    clusters = {str(c.cluster.name) for c, _ in runs}
    if len(clusters) > 1:
        raise _bad(
            "RUN_DIR",
            f"the runs were trained on different clusters {sorted(clusters)}",
            "calibrate one cluster profile at a time",
        )
    base = runs[0][0].cluster
    obs = [o for cfg, rows in runs for o in run_observations(cfg, rows)]
    coef = fit(obs, coefficients(base), prior_weight)
    profile = OmegaConf.to_container(base)
    for key, name in PROFILE_KEYS.items():
        profile[name] = float(1.0 / coef[key])
    profile["call_overhead_s"] = float(coef["calls"])
    for key, name in OVERHEAD_KEYS.items():
        profile[name] = float(coef[key])
    profile["dispatch_overhead_s"] = float(coef["dispatch"])
    profile["name"] = Path(out).stem
    profile["profile"] = "calibrated: " + ", ".join(str(Path(d)) for d in run_dirs)
    # replaces the published-anchor provenance of the prior profile (conf/cluster/*.yaml)
    profile["provenance"] = f"calibrated on this cluster, {len(run_dirs)} runs"
    fits = [
        {"observation": label, "measured_s": y, "fitted_s": seconds(f, {**coef}), "features": f}
        for f, y, label in obs
    ]
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Written by `dhp calibrate` (least squares on relative errors; dhp/plan/calibrate.py)\n"
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(profile)), encoding="utf-8")
    return {"profile": profile, "observations": fits}
