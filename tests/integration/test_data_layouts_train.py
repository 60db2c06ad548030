"""Training on the layouts users already have: one run whose dataset list holds one entry per layout
(LLaMA-Factory v0 images/videos through dataset_info.json, ShareGPT, LLaMA-Factory v1 typed parts,
ms-swift, four WebDataset layouts) trains 2 steps on the tiny model, and the one-line
``dhp train conf=... data.path=FILE`` trains on a LLaMA-Factory-style file. Each layout's records are
checked one by one in tests/unit/data/test_layouts.py."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from cli_here import dhp_here, explain
from plans import ALL_ONE

from dhp.config.data_shortcuts import CACHE_ENV
from dhp.runtime.loop.train import train
from dhp.validation import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "data"))  # the layout builders
from layouts_build import DEMO, every_layout

pytestmark = [pytest.mark.integration, pytest.mark.slow]
VIDEO = {"video_fps": 4.0, "video_folder_fps": 4.0, "video_max_frames": 8}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from dhp.models import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny")


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_mix_of_every_layout_trains_two_steps(ray_local, tmp_path, tiny_dir):
    """data=PATH.yaml names a data file listing one dataset per layout; 2 steps of 10 samples, unshuffled,
    reach every dataset (19 records, dataset after dataset)."""
    entries = []
    for e in every_layout(tmp_path):
        entry = {"name": e.name, "path": e.path}
        entry.update({k: getattr(e, k) for k in ("info", "image_root") if getattr(e, k)})
        entries.append(entry)
    data_file = tmp_path / "layouts.yaml"
    data_file.write_text(yaml.safe_dump({"kind": "llava", "datasets": entries, "shuffle": False, **VIDEO}))
    cfg = load_config(
        "tiny_vlm_demo",
        [
            f"data={data_file}",
            f"model.path={tiny_dir}",
            f"train.output_dir={tmp_path / 'runs'}",
            "name=layouts",
            "train.steps=2",
            "train.warmup_steps=0",
            "train.global_batch_size=10",
            *ALL_ONE,
        ],
    )
    assert [d.name for d in cfg.data.datasets] == [e["name"] for e in entries]
    from dhp.data import build_run_loader
    from dhp.plan.compile import module_layouts

    loader = build_run_loader(cfg, module_layouts(cfg))
    loader.close()
    assert sum(loader.sizes) == 19 and all(loader.sizes)  # 2 steps x 10 samples reach every dataset
    train(cfg)
    (run_dir,) = (tmp_path / "runs" / "layouts").iterdir()
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows) and rows[-1]["bad_samples"] == {}
    assert not (run_dir / "bad_samples.jsonl").exists()


def test_one_line_data_path_trains_a_llamafactory_file(ray_local, tmp_path, monkeypatch):
    """`dhp train conf=tiny_vlm data.path=my.json train.steps=2` on LLaMA-Factory's mllm_demo layout
    (absolute image paths), with no model.path: the run writes the tiny checkpoint to the cache and names
    it; a record with an audio list is skipped and named in bad_samples.jsonl."""
    rows = json.loads((DEMO / "mllm_demo.json").read_text()) * 2
    for r in rows:
        r["images"] = [str(DEMO / p) for p in r["images"]]
    rows.append(json.loads((DEMO / "mllm_audio_demo.json").read_text())[0])
    my = tmp_path / "my.json"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))  # the run writes the tiny checkpoint here
    my.write_text(json.dumps(rows))
    result = dhp_here(
        "train",
        "conf=tiny_vlm",
        f"data.path={my}",
        "train.steps=2",
        f"train.output_dir={tmp_path / 'runs'}",
        "train.warmup_steps=0",
        "data.shuffle=false",
        "data.on_bad_sample=skip",
        *ALL_ONE,
    )
    assert result.exit_code == 0, explain(result)
    (ckpt,) = (tmp_path / "cache" / "tiny_checkpoints").iterdir()
    said = f"using the tiny random qwen2_5_vl checkpoint at {ckpt}"
    assert "".join(said.split()) in "".join(result.output.split())  # the console may wrap inside the path
    (run_dir,) = (tmp_path / "runs" / "tiny_vlm").iterdir()
    assert [r["step"] for r in _rows(run_dir)] == [1, 2]
    (skipped,) = [json.loads(x) for x in (run_dir / "bad_samples.jsonl").read_text().splitlines()]
    assert skipped["location"] == f"{my}[6]" and skipped["reason"] == "unsupported_modality"
    # a cleared cache: export writes the same tiny checkpoint again and copies its tokenizer and processor
    shutil.rmtree(ckpt)
    exported = dhp_here("export", str(run_dir), str(tmp_path / "hf"))
    assert exported.exit_code == 0, explain(exported)
    assert (ckpt / "config.json").is_file()
    assert {"tokenizer_config.json", "preprocessor_config.json"} <= {
        p.name for p in (tmp_path / "hf").iterdir()
    }
