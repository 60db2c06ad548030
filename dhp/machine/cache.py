"""The per-machine profile cache: probe numbers first, then a fit of this machine's own runs.

Layout: ``$DHP_CACHE_DIR`` (default ``~/.cache/dhp``) ``/machines/<machine key>/<cluster name>/``
holds ``runs.json`` (the run dirs trained here, newest last, at most :data:`MAX_RUNS`) and
``profile.yaml`` (``dhp calibrate``'s fit of those runs, :func:`dhp.plan.calibrate.calibrate`: the
same fitter, anchored to the profile the runs were planned with). The machine key is the host name,
the CPU model and the core count, so a cache copied to another machine is not used there.

Only a local CPU cluster still on its built-in numbers (``provenance`` "built-in defaults",
``profile`` "defaults", no Ray address) is replaced: a calibrated or anchored profile, or a cluster
reached over Ray, is the user's and kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dhp.errors import DhpError
from dhp.machine.probe import Probe, probe_machine

#: "off" keeps the built-in cluster numbers (deterministic plans: unit tests, benchmarks)
ENV = "DHP_MACHINE_PROFILE"
CACHE_ENV = "DHP_CACHE_DIR"
DEFAULT_PROVENANCE = "built-in defaults"
MAX_RUNS = 8
#: how much the probed profile anchors the fit of this machine's runs (``dhp calibrate`` uses 2.0,
#: chosen for held-out plans). Here the runs are this machine's own, mostly of the recipes it will
#: plan again: one run of a plan 3x off the probe must bring its estimate within 1.25x, which
#: takes an anchor this light (2.0 moves it ~10% of the way; tests/unit/machine measures it).
CACHE_PRIOR_WEIGHT = 0.1
#: the cluster keys a fit of this machine's runs sets (dhp calibrate's coefficients + probed rates)
FIT_KEYS = (
    "peak_bf16_tflops",
    "hbm_gbps",
    "intra_node_gbps",
    "inter_node_gbps",
    "latency_us",
    "matmul_efficiency",
    "attention_efficiency",
    "comm_efficiency",
    "memory_efficiency",
    "call_overhead_s",
    "dispatch_overhead_s",
    "block_overhead_s",
    "dtensor_block_overhead_s",
    "fsdp_block_overhead_s",
    "attention_call_overhead_s",
    "collective_overhead_s",
    "tensor_overhead_s",
)


def machine_key() -> str:
    """``<host>-<hash of host, CPU model, cores>``: one cache per machine."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        model = platform.processor()
    ident = f"{platform.node()}|{model}|{os.cpu_count()}"
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in platform.node())[:40] or "host"
    return f"{host}-{hashlib.sha256(ident.encode()).hexdigest()[:10]}"


def cache_dir(cluster_name: str) -> Path:
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dhp")
    return root / "machines" / machine_key() / cluster_name


def applies(cluster: DictConfig) -> bool:
    """True for a local CPU cluster on its built-in numbers (and the probe not turned off)."""
    return (
        os.environ.get(ENV, "").lower() not in ("off", "0", "false", "no")
        and cluster.device == "cpu"
        and not cluster.ray_address
        and not os.environ.get("RAY_ADDRESS")
        and cluster.provenance == DEFAULT_PROVENANCE
        and cluster.profile == "defaults"
    )


def machine_profile(config: DictConfig) -> DictConfig:
    """``config`` with ``cluster`` set to this machine's numbers when :func:`applies`, else as is.

    With runs cached: their fit (``provenance`` "profile: this machine, N runs"). Without: the
    probe's rates over the built-in efficiencies (each rate = measured / the efficiency it is
    used at, so the planner's achieved rate is the measured one); overheads keep their priors.
    """
    if not applies(config.cluster):
        return config
    d = cache_dir(str(config.cluster.name))
    runs = _runs(d)
    fit = d / "profile.yaml"
    if runs and fit.is_file():
        fitted = OmegaConf.load(fit)
        values = {k: float(fitted[k]) for k in FIT_KEYS if k in fitted}
        n = len(runs)
        values["provenance"] = f"profile: this machine, {n} run{'s' if n != 1 else ''} ({d})"
        values["profile"] = "calibrated: this machine"
    else:
        values = probe_values(config.cluster, probe_machine())
    return _with_cluster(config, values)


def probe_values(cluster: DictConfig, probe: Probe) -> dict:
    """The cluster numbers a probe gives, over ``cluster``'s efficiencies."""
    link = probe.allreduce_gbps / cluster.comm_efficiency
    return {
        "peak_bf16_tflops": probe.matmul_gflops / 1e3 / cluster.matmul_efficiency,
        "hbm_gbps": probe.copy_gbps / cluster.memory_efficiency,
        "intra_node_gbps": link,
        "inter_node_gbps": link,
        "latency_us": probe.allreduce_latency_us,
        "provenance": f"profile: this machine, probed in {probe.seconds:.1f} s ({probe.summary()}), no runs yet",
    }


def record_run(run_dir: Path, config: DictConfig) -> str | None:
    """After a local run planned on this machine's profile: add ``run_dir`` to the cache and refit.

    Returns the new provenance line, or None when the run does not count (another cluster, the
    probe off, no step measured). A fit that fails leaves the previous cache as it was.
    """
    from dhp.plan.calibrate import calibrate  # the fitter loads only when a run refines the cache

    cluster = config.cluster
    if not str(cluster.provenance).startswith("profile: this machine"):
        return None
    if os.environ.get(ENV, "").lower() in ("off", "0", "false", "no"):
        return None
    metrics = Path(run_dir) / "metrics.jsonl"
    if not metrics.is_file() or not any(ln.strip() for ln in metrics.read_text().splitlines()):
        return None
    d = cache_dir(str(cluster.name))
    d.mkdir(parents=True, exist_ok=True)
    runs = [r for r in _runs(d) if r != str(Path(run_dir).resolve()) and _readable(r)]
    runs = [*runs, str(Path(run_dir).resolve())][-MAX_RUNS:]
    tmp = d / f"profile.yaml.tmp-{os.getpid()}"
    calibrate(runs, out=str(tmp), prior_weight=CACHE_PRIOR_WEIGHT)
    tmp.replace(d / "profile.yaml")
    _write_json(d / "runs.json", {"runs": runs})
    return f"profile: this machine, {len(runs)} run{'s' if len(runs) != 1 else ''} ({d})"


def _runs(d: Path) -> list[str]:
    """The cached run dirs that still exist with their metrics."""
    path = d / "runs.json"
    if not path.is_file():
        return []
    try:
        runs = json.loads(path.read_text())["runs"]
    except (ValueError, KeyError, TypeError):
        return []  # a damaged cache counts as none; the next run rewrites it
    return [r for r in runs if (Path(r) / "metrics.jsonl").is_file() and (Path(r) / "config.yaml").is_file()]


def _readable(run_dir: str) -> bool:
    """Whether this version of dhp reads a cached run's config (one written by another version, with
    keys this one does not know, is left out of the fit instead of failing every later refit)."""
    from dhp.plan.calibrate import load_run  # the fitter's reader loads only when a run refines the cache

    try:
        load_run(run_dir)
    except DhpError:
        return False
    return True


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _with_cluster(config: DictConfig, values: dict) -> DictConfig:
    out = config.copy()
    OmegaConf.set_readonly(out, False)
    for k, v in values.items():
        out.cluster[k] = v
    OmegaConf.set_readonly(out, OmegaConf.is_readonly(config))
    return out
