"""wandb (offline) and MLflow (file store) log what ``metrics.jsonl`` holds, through the real CLI.

One tiny run (every degree 1, 2 steps) with ``metrics.loggers=[jsonl,tensorboard,wandb,mlflow]``,
then a resume of it to step 3, are shared by the module (``dhp train`` in this process, on the
shared test Ray). Checked:
- every scalar of every metrics.jsonl record equals the wandb offline history and the MLflow metric
  history at the same step (exact: both store the float64 value);
- the resolved config is the tracker run's config/params; config.yaml and plan.json are its files;
- the resumed run continues the same wandb id and the same MLflow run (steps 1..3 in one history).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_here import dhp_here, explain
from plans import ALL_ONE

pytestmark = [pytest.mark.integration, pytest.mark.slow]
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

LOGGERS = "metrics.loggers=[jsonl,tensorboard,wandb,mlflow]"


def _train(out: Path, *extra: str) -> None:
    """``dhp train`` of the shared tiny run, in this process on the shared test Ray."""
    args = ["train", "conf=tiny_vlm", "name=lg", *ALL_ONE, LOGGERS]
    args += [f"metrics.mlflow.tracking_uri=file:{out / 'mlruns'}", f"train.output_dir={out}", *extra]
    result = dhp_here(*args)
    assert result.exit_code == 0, explain(result)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ray_local) -> Iterator[tuple[Path, Path, Path]]:
    out = tmp_path_factory.mktemp("runs")
    # metrics.wandb.mode is null by default: wandb follows $WANDB_MODE, as users set it
    env = {"MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        _train(out, "train.steps=2")
        (first,) = (out / "lg").iterdir()
        _train(out, "train.steps=3", "train.resume=auto")
        (second,) = [d for d in (out / "lg").iterdir() if d != first]
        yield out, first, second


def _jsonl(run_dir: Path) -> dict[int, dict[str, float]]:
    from dhp.metrics.loggers import flat_scalars

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: flat_scalars(r) for r in rows}


def _wandb_records(path: Path) -> list:
    """The protobuf records of a wandb ``.wandb`` file (LevelDB log framing: 7-byte file header,
    32 KiB blocks, each chunk = crc32 (4) + length (2, little endian) + type (1: full, 2-4: parts))."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def _wandb_history(run_dir: Path) -> tuple[str, dict[int, dict[str, float]], dict]:
    (wb,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    hist, config = {}, {}
    for rec in _wandb_records(wb):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
            hist[int(row.pop("_step"))] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind in ("run", "config"):  # init's config rides on the run record, later updates alone
            items = rec.run.config.update if kind == "run" else rec.config.update
            config |= {i.key: json.loads(i.value_json) for i in items if i.key != "_wandb"}
    return wb.stem.removeprefix("run-"), hist, config


def test_wandb_offline_history_equals_metrics_jsonl(runs):
    _, first, second = runs
    run_id, hist, config = _wandb_history(first)
    assert hist == _jsonl(first)  # every scalar, every step, exactly
    assert config["train"]["steps"] == 2 and config["name"] == "lg"
    files = {p.name for p in first.glob("wandb/offline-run-*/files/*/*")}
    assert {"config.yaml", "plan.json"} <= files, files
    # the resumed run continues the same wandb run id, at steps after the checkpoint
    run_id2, hist2, _ = _wandb_history(second)
    assert run_id2 == run_id
    assert hist2 == _jsonl(second) and sorted(hist2) == [3]
    assert json.loads((second / "trackers.json").read_text())["wandb"]["id"] == run_id


def test_mlflow_file_store_history_equals_metrics_jsonl(runs):
    from mlflow.tracking import MlflowClient

    out, first, second = runs
    ids = json.loads((first / "trackers.json").read_text())
    run_id = ids["mlflow"]["run_id"]
    assert json.loads((second / "trackers.json").read_text())["mlflow"]["run_id"] == run_id
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=f"file:{out / 'mlruns'}")
    run = client.get_run(run_id)
    expected = _jsonl(first) | _jsonl(second)  # one MLflow run: steps 1, 2, then 3 after the resume
    assert sorted(expected) == [1, 2, 3]
    for key in expected[1]:
        got = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert got == {s: row[key] for s, row in expected.items()}, key
    assert run.data.params["train.lr"] == "0.001" and run.data.params["name"] == "lg"
    arts = {a.path for a in client.list_artifacts(run_id, first.name)}
    assert arts == {f"{first.name}/config.yaml", f"{first.name}/plan.json"}, arts
    assert {a.path for a in client.list_artifacts(run_id)} == {first.name, second.name}
    assert run.info.status == "FINISHED"


def test_tensorboard_logger_listed_in_metrics_loggers(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, first, _ = runs
    acc = EventAccumulator(str(first / "tb"))
    acc.Reload()
    rows = _jsonl(first)
    assert {s: rows[s]["loss"] for s in rows} == {e.step: pytest.approx(e.value) for e in acc.Scalars("loss")}
