"""wandb (offline) and MLflow (file store) log what ``metrics.jsonl`` holds, through the real CLI.

One tiny run (every degree 1, 2 steps) with ``metrics.loggers=[jsonl,tensorboard,wandb,mlflow]``,
then ``train.resume=auto`` of it to step 3, are shared by the module (``dhp train`` in this process,
on the shared test Ray). Checked:
- every scalar of every metrics.jsonl record equals the wandb offline history and the MLflow metric
  history at the same step (exact: both store the float64 value);
- the resolved config is the tracker run's config/params; config.yaml and plan.json are its files;
- the resume continues its own run dir: one metrics.jsonl (steps 1, 2, a resume event, 3), one
  TensorBoard log dir, the same wandb id and the same MLflow run (steps 1..3 in one history);
  ``dhp runs`` lists one finished run and ``dhp report`` draws one curve with the resume marked;
- ``train.resume=fork`` (to step 4, last) writes a new run dir with new tracker runs.
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
def runs(tmp_path_factory, ray_local) -> Iterator[tuple[Path, Path]]:
    out = tmp_path_factory.mktemp("runs")
    # metrics.wandb.mode is null by default: wandb follows $WANDB_MODE, as users set it
    env = {"MLFLOW_ALLOW_FILE_STORE": "true", "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        _train(out, "train.steps=2")
        _train(out, "train.steps=3", "train.resume=auto")
        (run,) = (out / "lg").iterdir()  # the resume continued the run's own directory
        yield out, run


def _jsonl(run_dir: Path) -> dict[int, dict[str, float]]:
    from dhp.metrics.loggers import flat_scalars

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: flat_scalars(r) for r in rows if "event" not in r}


def test_resume_continues_its_run_dir(runs):
    out, run = runs
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event", r["step"]) for r in rows] == [1, 2, "resume", 3], rows
    assert rows[2]["step"] == 2 and rows[2]["resume_from"].endswith("checkpoints/step_000002")
    listed = dhp_here("runs", str(out))
    assert listed.exit_code == 0, explain(listed)
    (row,) = [ln for ln in listed.output.splitlines() if run.name in ln]  # one run, finished
    assert "finished" in row and "3/3" in row, listed.output
    report = dhp_here("report", str(run), "--out", str(out / "png"))
    assert report.exit_code == 0, explain(report)
    assert "resumed at step 2" in " ".join(report.output.replace("│", " ").split()), report.output
    assert "steps 1..3" in report.output


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


def _wandb_history(wb: Path) -> tuple[str, dict[int, dict[str, float]], dict]:
    """(run id, {step: scalars}, config) of one offline run file ``run-<id>.wandb``."""
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
    _, run = runs
    # one offline run dir per segment (wandb's offline resume), both of the same wandb run id
    first, second = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    run_id, hist, config = _wandb_history(first)
    run_id2, hist2, _ = _wandb_history(second)
    assert run_id2 == run_id
    assert hist | hist2 == _jsonl(run) and sorted(hist) == [1, 2] and sorted(hist2) == [3]
    assert config["train"]["steps"] == 2 and config["name"] == "lg"
    files = {p.name for p in first.parent.glob("files/*/*")}
    assert {"config.yaml", "plan.json"} <= files, files
    assert json.loads((run / "trackers.json").read_text())["wandb"]["id"] == run_id


def test_mlflow_file_store_history_equals_metrics_jsonl(runs):
    from mlflow.tracking import MlflowClient

    out, run = runs
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]["run_id"]
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(tracking_uri=f"file:{out / 'mlruns'}")
    mlrun = client.get_run(run_id)
    expected = _jsonl(run)  # one MLflow run: steps 1, 2, then 3 after the resume
    assert sorted(expected) == [1, 2, 3]
    for key in expected[1]:
        got = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert got == {s: row[key] for s, row in expected.items()}, key
    assert mlrun.data.params["train.lr"] == "0.001" and mlrun.data.params["name"] == "lg"
    arts = {a.path for a in client.list_artifacts(run_id, run.name)}
    seg = f"{run.name}/resumed_at_step_2"
    assert arts == {f"{run.name}/config.yaml", f"{run.name}/plan.json", seg}, arts
    assert {a.path for a in client.list_artifacts(run_id, seg)} == {f"{seg}/config.yaml", f"{seg}/plan.json"}
    assert {a.path for a in client.list_artifacts(run_id)} == {run.name}
    assert mlrun.info.status == "FINISHED"


def test_tensorboard_logger_listed_in_metrics_loggers(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run = runs
    acc = EventAccumulator(str(run / "tb"))  # one log dir: both segments' event files
    acc.Reload()
    rows = _jsonl(run)
    assert {s: rows[s]["loss"] for s in rows} == {e.step: pytest.approx(e.value) for e in acc.Scalars("loss")}
    assert sorted(e.step for e in acc.Scalars("loss")) == [1, 2, 3]


def test_fork_resumes_into_a_new_run_dir_and_new_tracker_runs(runs):
    """``train.resume=fork``: the newest checkpoint (step 3) into a new run dir, with new W&B and
    MLflow runs; the run it forked from is left as it was."""
    out, run = runs
    before = (run / "metrics.jsonl").read_text()
    _train(out, "train.steps=4", "train.resume=fork")
    (forked,) = [d for d in (out / "lg").iterdir() if d != run]
    assert sorted(_jsonl(forked)) == [4] and (run / "metrics.jsonl").read_text() == before
    old, new = (json.loads((d / "trackers.json").read_text()) for d in (run, forked))
    assert new["wandb"]["id"] != old["wandb"]["id"] and new["mlflow"]["run_id"] != old["mlflow"]["run_id"]
