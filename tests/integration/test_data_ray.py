"""data.engine=ray: the same batches as local (token tensors, pixels, balance, T), pixels off the
driver, an exact resume, and training losses equal to local's. One local Ray for the module."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from dhp.config.schema import DataConfig, DatasetEntry, TrainConfig
from dhp.data.loader import build_loader
from dhp.data.remote import RemoteRows

pytestmark = pytest.mark.integration
DEMO = "pkg://dhp.data_assets/demo"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from dhp.models import get_family, make_tiny_checkpoint

    out = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"))
    return replace(get_family("qwen2_5_vl").tiny_model_config(), path=str(out))


def _loader(tiny_model, engine: str, **data_kw):
    data = DataConfig(
        kind="llava",
        datasets=[
            DatasetEntry(name="c", path=f"{DEMO}/captions.json", image_root=f"{DEMO}/images"),
            DatasetEntry(name="m", path=f"{DEMO}/mixed.jsonl", image_root=f"{DEMO}/images", weight=0.5),
        ],
        engine=engine,
        num_workers=2,
        **data_kw,
    )
    train = TrainConfig(global_batch_size=4, micro_batch_size=1, seed=3)
    return build_loader(
        data=data, model=tiny_model, train=train, dp_size=2, patch_seq_len=4096, token_seq_len=2048
    )


def _same(a, b) -> None:
    assert a.step == b.step and a.num_label_tokens == b.num_label_tokens
    for row_a, row_b in zip(a.micro_batches, b.micro_batches, strict=True):
        for x, y in zip(row_a, row_b, strict=True):
            assert x.sample_ids == y.sample_ids
            for f in ("input_ids", "attention_mask", "labels", "mm_token_type_ids", "image_grid_thw"):
                assert (getattr(x, f) is None and getattr(y, f) is None) or torch.equal(
                    getattr(x, f), getattr(y, f)
                )
            if x.pixel_values is not None:
                assert isinstance(y.pixel_values, RemoteRows)  # no pixel byte on the driver
                assert torch.equal(x.pixel_values, y.pixel_values.resolve())


@pytest.mark.slow
def test_ray_batches_equal_local_across_an_epoch_and_resume(ray_local, tiny_model):
    local, remote = _loader(tiny_model, "local"), _loader(tiny_model, "ray")
    try:
        steps = 7  # 21.5 samples an epoch at weight 0.5: crosses into epoch 2
        ref = [next(local) for _ in range(steps)]
        got = []
        for k in range(steps):
            got.append(next(remote))
            if k == 2:
                saved = remote.state_dict()
        for a, b in zip(ref, got, strict=True):
            _same(a, b)
        assert got[-1].metrics["workers"] == 2.0 and got[-1].metrics["samples_per_s"] > 0
        remote.load_state_dict(saved)  # rewinds with a step prefetched and samples in flight
        for a in ref[3:]:
            _same(a, next(remote))
    finally:
        local.close()
        remote.close()


# one rank per module: the data engine is what differs between the runs, and two actors start in
# half the time of tiny_vlm's four (the parallel plans' numerics are proven by the verify tests)
ONE_EACH = [
    "placement=disaggregated",
    "modules.vision.gpus=1",
    "modules.vision.parallel.sp=1",
    "modules.llm.gpus=1",
    "modules.llm.parallel.tp=1",
]


def _train(out, name: str, *overrides: str):
    """``dhp train conf=tiny_vlm train.steps=4`` on one rank per module, in this process (the
    module's Ray: no second start)."""
    from rich.console import Console

    from dhp.runtime.loop.train import train
    from dhp.validation import load_config

    cfg = load_config(
        "tiny_vlm",
        [
            f"name={name}",
            f"train.output_dir={out}",
            "train.steps=4",
            "data.num_workers=2",
            *ONE_EACH,
            *overrides,
        ],
    )
    return train(cfg, console=Console(file=open(os.devnull, "w")))


@pytest.mark.slow  # three tiny_vlm trainings (local, ray, ray resumed)
def test_train_losses_equal_local_and_resume_under_ray(ray_local, tmp_path):
    local = _train(tmp_path, "local", "data.engine=local")
    ray_run = _train(tmp_path, "ray", "data.engine=ray", "train.checkpoint_every=2")
    assert sorted(local.losses) == [1, 2, 3, 4]
    for step, loss in local.losses.items():  # same samples, same order: 1e-6 relative (fp32 CPU)
        assert abs(ray_run.losses[step] - loss) <= 1e-6 * abs(loss), (step, ray_run.losses, local.losses)
    ckpt = next(p for p in (ray_run.run_dir / "checkpoints").iterdir() if p.name.endswith("000002"))
    resumed = _train(tmp_path, "resumed", "data.engine=ray", f"train.resume={ckpt}")
    assert sorted(resumed.losses) == [3, 4]
    for step in (3, 4):  # the data position restored under ray: the uninterrupted losses
        assert abs(resumed.losses[step] - ray_run.losses[step]) <= 1e-6 * abs(ray_run.losses[step])


@pytest.mark.slow
def test_ray_skip_policy_counts_bad_runs_within_one_epoch_pass(ray_local, tiny_model, tmp_path):
    """The Ray engine's skip policy, as the local one's (tests/unit/data/test_loader.py): seed 0 orders 4
    records [0,1,3,2] (epoch 2) then [2,3,1,0] (epoch 3); with 2 and 3 bad, four bad records in a row
    span the boundary and the run goes on; each skipped record is named in the step's ``skipped``."""
    import json

    turns = [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A cat."}]
    rows = [{"image": "cat.jpg", "conversations": turns}] * 2
    rows += [{"image": f"missing_{i}.jpg", "conversations": turns} for i in range(2)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(
        kind="llava",
        datasets=[DatasetEntry(name="d", path=str(path), image_root=f"{DEMO}/images")],
        engine="ray",
        num_workers=1,
        on_bad_sample="skip",
        prefetch=False,
    )
    train = TrainConfig(global_batch_size=2, micro_batch_size=1, seed=0)
    loader = build_loader(
        data=data, model=tiny_model, train=train, dp_size=1, patch_seq_len=4096, token_seq_len=2048
    )
    try:
        steps = [next(loader) for _ in range(6)]
    finally:
        loader.close()
    served = [sid for s in steps for b in s.replica(0) for sid in b.sample_ids]
    assert sorted({s.rsplit(":", 1)[1] for s in served}) == ["1", "2"]
    named = [k["location"].rsplit(":", 1)[1] for s in steps for k in s.skipped]
    assert sorted(set(named)) == ["3", "4"] and len(named) == steps[-1].bad_samples["missing_file"]
