"""``dhp calibrate``: fit the step-time model's efficiencies to measured runs.

For every run directory (``config.yaml`` + ``metrics.jsonl``), each module gives three
observations per step: ``<m>_fwd_s`` and ``<m>_bwd_s`` (summed over the step's micro-batches, max
over ranks) and ``<m>_step_s`` (clip + AdamW). The model predicts each as FEATURES . x
(``dhp.plan.estimate``: seconds at efficiency 1 of matmul, attention, communication and memory
traffic, and a count of calls), where x = (1/matmul_eff, 1/attention_eff, 1/comm_eff,
1/memory_eff, call_overhead_s). The fit minimises the squared RELATIVE error over all observations
(each row divided by its measurement), with x >= 0: a coefficient the runs cannot determine (its
feature is zero everywhere, or the unconstrained fit makes it negative) keeps the profile's prior
value. Then ``dispatch_overhead_s`` is the median per micro-batch of what the measured ``step_s``
has beyond the modelled schedule. Measurements: the median over logged steps, the first one
(warm-up) dropped when there are more.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from dhp.errors import ConfigError, ConfigIssue
from dhp.plan.estimate import FEATURES, coefficients, module_features, seconds, vision_tokens_per_rank

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
    from dhp.config import load_config

    d = Path(run_dir)
    cfg_path, metrics = d / "config.yaml", d / "metrics.jsonl"
    if not cfg_path.is_file() or not metrics.is_file():
        raise _bad(
            str(d),
            "not a run directory (needs config.yaml and metrics.jsonl)",
            "pass runs/<name>/<timestamp> directories written by dhp train",
        )
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
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

    n_mb = micro_batches_per_step(config)
    out = []
    for name, shape in module_shapes(config).items():
        world = int(config.modules[name].gpus)
        tokens = vision_tokens_per_rank(config, shape) if name == "vision" else shape.tokens
        f = module_features(shape, tokens, config.cluster, world)
        out.append(({k: n_mb * v for k, v in f.fwd.items()}, measured(rows, f"{name}_fwd_s"), f"{name}_fwd"))
        if shape.backward:
            out.append(
                ({k: n_mb * v for k, v in f.bwd.items()}, measured(rows, f"{name}_bwd_s"), f"{name}_bwd")
            )
        if not shape.freeze:
            step = {**dict.fromkeys(FEATURES, 0.0), "memory": f.step["memory"], "calls": f.step["calls"]}
            out.append((step, measured(rows, f"{name}_step_s"), f"{name}_step"))
    return out


def fit(obs: list[tuple[dict[str, float], float, str]], prior: dict[str, float]) -> dict[str, float]:
    """Non-negative least squares on relative errors; undetermined coefficients keep ``prior``."""
    free = [k for k in FEATURES if any(f[k] > 0 for f, _, _ in obs)]
    fixed = {k: prior[k] for k in FEATURES if k not in free}
    while free:
        a = np.array([[f[k] / y for k in free] for f, y, _ in obs if y > 0])
        rest = np.array([sum(f[k] * fixed[k] for k in fixed) / y for f, y, _ in obs if y > 0])
        x, *_ = np.linalg.lstsq(a, 1.0 - rest, rcond=None)
        if (x > 0).all():
            return {**fixed, **dict(zip(free, (float(v) for v in x), strict=True))}
        worst = free[int(np.argmin(x))]
        fixed[worst] = prior[worst]
        free.remove(worst)
    return fixed


def calibrate(run_dirs: list[str], *, out: str) -> dict:
    """Fit the profile on ``run_dirs`` and write it to ``out`` (a cluster YAML); returns a report."""
    from dhp.plan.compile import compile_plan, micro_batches_per_step

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
    coef = fit(obs, coefficients(base))
    profile = OmegaConf.to_container(base)
    for key, name in PROFILE_KEYS.items():
        profile[name] = float(1.0 / coef[key])
    profile["call_overhead_s"] = float(coef["calls"])
    profile["dispatch_overhead_s"] = 0.0
    profile["name"] = Path(out).stem
    profile["profile"] = "calibrated: " + ", ".join(str(Path(d)) for d in run_dirs)
    residual = []
    for cfg, rows in runs:
        fitted = OmegaConf.merge(cfg, {"cluster": profile})
        est = compile_plan(fitted).estimate
        residual.append((measured(rows, "step_s") - est["step_time_s"]) / micro_batches_per_step(cfg))
    profile["dispatch_overhead_s"] = max(0.0, float(statistics.median(residual)))
    fits = [
        {"observation": label, "measured_s": y, "fitted_s": seconds(f, {**coef}), "features": f}
        for f, y, label in obs
    ]
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Written by `dhp calibrate` (least squares on relative errors; dhp/plan/calibrate.py)\n"
    path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(profile)), encoding="utf-8")
    return {"profile": profile, "observations": fits}
