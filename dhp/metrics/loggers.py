"""Experiment loggers beside ``metrics.jsonl``: TensorBoard, Weights & Biases and MLflow.

Each logger receives the same scalars as the JSONL record (nested groups such as ``peak_mem_bytes``
flattened to ``peak_mem_bytes/vision/0``) at the record's step. wandb and mlflow are optional
extras, imported only here and only when configured (``dhp.config.validate_metrics`` has already
checked they are installed). The resolved config is the tracker run's config/params; ``config.yaml``
and ``plan.json`` are its files/artifacts.

Resume: ``trackers.json`` in the run directory records each tracker's run id. A run that continues
its run directory from ``<run>/checkpoints/step_N`` (``train.resume=auto``, or a restart) reads
``<run>/trackers.json`` and continues the same tracker run (wandb ``id`` + ``resume="allow"``, MLflow
``run_id``), and TensorBoard writes into the same ``tb/`` with the events after step N purged, so
each curve continues at step N+1. A new run directory (``train.resume=fork``) starts new tracker runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Protocol

from dhp.errors import ConfigError

TRACKERS_FILE = "trackers.json"


class ExperimentLogger(Protocol):
    """One destination for step scalars."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def flat_scalars(record: dict[str, Any]) -> dict[str, float]:
    """Every number of a metrics record except ``step``; nested dicts become ``group/key`` names."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[prefix] = float(value)

    for key, value in record.items():
        if key != "step":
            walk(key, value)
    return out


def flat_config(tree: Any, prefix: str = "") -> dict[str, str]:
    """A resolved config as ``dotted.key -> str(value)`` (MLflow params are flat strings)."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for k, v in tree.items():
            out |= flat_config(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: json.dumps(tree) if isinstance(tree, list) else str(tree)}


class TensorBoardLogger:
    """Scalars as TensorBoard events under ``log_dir`` (``<run_dir>/tb``); ``purge_step``: a resumed
    run hides the events a previous attempt logged at that step and after (TensorBoard's own rule)."""

    def __init__(self, log_dir: Path, *, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._tb.close()


class WandbLogger:
    """A wandb run in ``<run_dir>/wandb`` (offline: ``offline-run-*``; ``wandb sync`` uploads it)."""

    def __init__(
        self, cfg: Any, *, run_dir: Path, name: str, config: dict, files: list[Path], run_id: str | None
    ) -> None:
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=str(run_dir),
            name=name,
            id=run_id,
            resume="allow" if run_id else None,
            config=None if run_id else config,
            settings=wandb.Settings(console="off", quiet=True),
        )
        if run_id:  # a resumed run may change e.g. train.steps; keep the newest values
            self.run.config.update(config, allow_val_change=True)
        for f in files:  # a copy in the run's files dir: run.save of a file outside it symlinks it
            # and warns "Symlinked 1 file ..." once per file; a file already there is saved quietly
            dst = Path(self.run.dir) / f.parent.name / f.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
            self.run.save(str(dst), base_path=self.run.dir, policy="now")
        self.ident = {
            "id": self.run.id,
            "project": cfg.project,
            "mode": "offline" if self.run.offline else "online",
        }

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """An MLflow run (``metrics.mlflow.tracking_uri``; ``file:DIR`` is the file store)."""

    def __init__(
        self, cfg: Any, *, name: str, config: dict, files: list[Path], run_id: str | None, segment: str
    ) -> None:
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        try:
            self.client = MlflowClient(tracking_uri=cfg.tracking_uri)
            if run_id is None:
                exp = self.client.get_experiment_by_name(cfg.experiment)
                exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.experiment)
                run_id = self.client.create_run(exp_id, run_name=name).info.run_id
                params = flat_config(config)
                for i in range(0, len(params), 100):  # MLflow caps a batch at 100 params
                    chunk = list(params.items())[i : i + 100]
                    self.client.log_batch(run_id, params=[_param(k, v) for k, v in chunk], synchronous=True)
            else:
                self.client.update_run(run_id, status="RUNNING")
        except MlflowException as e:
            raise ConfigError(
                f"metrics.mlflow (tracking_uri={cfg.tracking_uri!r}, experiment={cfg.experiment!r}): "
                f"MLflow refused the run: {e}. Fix: set metrics.mlflow.tracking_uri to a reachable "
                "store (sqlite:///mlflow.db, http://host:5000, or file:DIR with MLFLOW_ALLOW_FILE_STORE=true)"
            ) from e
        self.run_id = run_id
        for f in files:  # one folder per run segment: a resumed run's config does not overwrite
            self.client.log_artifact(run_id, str(f), artifact_path=segment)
        self.ident = {"run_id": run_id, "tracking_uri": self.client.tracking_uri}

    def log(self, step: int, scalars: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        metrics = [self._metric(k, v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow caps a batch at 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000], synchronous=True)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _param(key: str, value: str) -> Any:
    from mlflow.entities import Param

    return Param(key[:250], value[:6000])


def continues(run_dir: Path, resumed_from: Path | None) -> int | None:
    """The checkpoint step when ``resumed_from`` is one of ``run_dir``'s own (the run continues its
    directory and tracker runs), else None (a fresh run, or a new run dir resumed from another's)."""
    if resumed_from is None or Path(resumed_from).resolve().parent.parent != Path(run_dir).resolve():
        return None
    return int(Path(resumed_from).name.removeprefix("step_"))


def previous_trackers(run_dir: Path) -> dict[str, dict]:
    """The tracker ids recorded in ``<run_dir>/trackers.json`` ({} if none)."""
    path = Path(run_dir) / TRACKERS_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def open_loggers(
    metrics: Any,
    *,
    tensorboard: bool,
    run_dir: Path,
    name: str,
    config: dict,
    resumed_from: Path | None,
) -> list[ExperimentLogger]:
    """Start the configured loggers for ``run_dir`` (``config.yaml`` and ``plan.json`` already written)
    and record the tracker run ids in ``<run_dir>/trackers.json``; a run resumed from one of
    ``run_dir``'s own checkpoints continues its tracker runs and TensorBoard log dir. ``tensorboard`` is the legacy
    ``train.tensorboard`` switch, the same as listing ``tensorboard`` in ``metrics.loggers``."""
    names = list(metrics.loggers)
    files = [run_dir / "config.yaml", run_dir / "plan.json"]
    files = [f for f in files if f.is_file()]
    step = continues(run_dir, resumed_from)
    before = previous_trackers(run_dir) if step is not None else {}
    label = f"{name}/{run_dir.name}"
    segment = run_dir.name if step is None else f"{run_dir.name}/resumed_at_step_{step}"
    out: list[ExperimentLogger] = []
    idents: dict[str, dict] = {}
    try:
        if tensorboard or "tensorboard" in names:
            out.append(TensorBoardLogger(run_dir / "tb", purge_step=None if step is None else step + 1))
        if "wandb" in names:
            prev = before["wandb"]["id"] if "wandb" in before else None
            wb = WandbLogger(
                metrics.wandb, run_dir=run_dir, name=label, config=config, files=files, run_id=prev
            )
            out.append(wb)
            idents["wandb"] = wb.ident
        if "mlflow" in names:
            prev = before["mlflow"]["run_id"] if "mlflow" in before else None
            ml = MlflowLogger(
                metrics.mlflow, name=label, config=config, files=files, run_id=prev, segment=segment
            )
            out.append(ml)
            idents["mlflow"] = ml.ident
    except BaseException:
        for lg in out:
            lg.close()
        raise
    if idents:
        (run_dir / TRACKERS_FILE).write_text(json.dumps(idents, indent=1), encoding="utf-8")
    return out
