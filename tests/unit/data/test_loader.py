"""The step loader: DP shards disjoint and complete, seeded order, exact resume, balance, bad-sample policy."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
import torch
from conftest import DEMO, demo_data, jsonl_data

from dhp.config.schema import DataConfig, SyntheticData, TrainConfig
from dhp.data import bad
from dhp.data.batch import Sample, collate
from dhp.data.loader import balance, build_loader
from dhp.data.source import epoch_order
from dhp.errors import ConfigError, DataError
from dhp.metrics.runs import count_skipped

pytestmark = pytest.mark.unit
N_DEMO = 25  # 18 records in captions.json + 7 in mixed.jsonl


def _loader(model, data, *, dp=2, gbs=6, mbs=1, seed=0, vision=1 << 20):
    train = TrainConfig(global_batch_size=gbs, micro_batch_size=mbs, seed=seed)
    return build_loader(
        data=data, model=model, train=train, dp_size=dp, patch_seq_len=vision, token_seq_len=1 << 20
    )


def _ids(step) -> list[list[str]]:
    """Sample ids per replica for one step."""
    return [[sid for b in step.replica(r) for sid in b.sample_ids] for r in range(len(step.micro_batches[0]))]


def _same(a, b) -> bool:
    return all(
        torch.equal(x.input_ids, y.input_ids)
        and x.sample_ids == y.sample_ids
        and (x.pixel_values is None or torch.equal(x.pixel_values, y.pixel_values))
        for ra, rb in zip(a.micro_batches, b.micro_batches, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


def test_dp_shards_are_disjoint_and_complete_over_an_epoch(tiny_model):
    loader = _loader(tiny_model, demo_data(), dp=2, gbs=6)
    assert loader.epoch_len == N_DEMO
    seen: list[str] = []
    for _ in range(5):  # 30 samples: all 25 of epoch 0, then the first 5 of epoch 1
        step = next(loader)
        per_replica = _ids(step)
        assert [len(r) for r in per_replica] == [3, 3]
        assert not set(per_replica[0]) & set(per_replica[1])  # no overlap between DP replicas
        seen += per_replica[0] + per_replica[1]
    src = loader.source
    everything = Counter(src.location(i) for i in range(len(src)))
    extra = Counter(seen) - everything
    assert set(everything) <= set(seen)  # no loss: every sample of epoch 0 was served
    assert sum(extra.values()) == 5
    expected_extra = [
        src.location(i)
        for i in epoch_order(sizes=[18, 7], weights=[1.0, 1.0], seed=0, epoch=1, shuffle=True)[:5]
    ]
    assert extra == Counter(expected_extra)  # and the overflow is exactly the head of epoch 1


def test_order_is_deterministic_from_the_seed(tiny_model):
    a, b, c = (_loader(tiny_model, demo_data(), seed=s) for s in (0, 0, 1))
    sa, sb, sc = next(a), next(b), next(c)
    assert _same(sa, sb)
    assert _ids(sa) != _ids(sc)
    unshuffled = _loader(tiny_model, demo_data(shuffle=False), dp=1, gbs=3)
    assert [sid.rsplit("/", 1)[1] for sid in sorted(_ids(next(unshuffled))[0])] == [
        "captions.json[0]",
        "captions.json[1]",
        "captions.json[2]",
    ]


def test_resume_yields_the_same_batches(tiny_model):
    """Save after step 3 (crossing into epoch 1 at step 4), JSON round-trip, resume: steps 4-5 identical."""
    full = _loader(tiny_model, demo_data(), dp=2, gbs=6)
    steps = [next(full) for _ in range(6)]
    first = _loader(tiny_model, demo_data(), dp=2, gbs=6)
    for _ in range(4):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = _loader(tiny_model, demo_data(), dp=2, gbs=6)
    resumed.load_state_dict(state)
    assert state["position"] == 24 and state["step"] == 4
    for k in (4, 5):
        again = next(resumed)
        assert again.step == k and _same(again, steps[k])
    other = _loader(tiny_model, demo_data(), seed=1)
    with pytest.raises(DataError, match="cannot resume the data position"):
        other.load_state_dict(state)


def _sample(patches: int, tokens: int = 10) -> Sample:
    side = int(patches**0.5)
    grid = torch.tensor([[1, side, side]]) if patches else None
    ids = torch.zeros(tokens, dtype=torch.long)
    return Sample(
        sample_id=f"s{patches}",
        input_ids=ids,
        labels=ids.clone(),
        mm_token_type_ids=ids.clone(),
        pixel_values=None,
        image_grid_thw=grid,
    )


def test_balance_equalises_vision_tokens_across_slots():
    samples = [_sample(p) for p in (4096, 1024, 0, 1024, 0, 1024, 0, 1024)]
    slots = balance(samples, num_slots=2, slot_size=4)
    loads = [sum(samples[i].num_patches for i in s) for s in slots]
    assert loads == [4096, 4096]  # a contiguous split would give 6144 / 2048
    assert sorted(i for s in slots for i in s) == list(range(8))  # a partition: nothing lost or doubled
    samples = [_sample(p) for p in (1024, 1024, 256, 256, 64, 64, 16, 16)]
    loads = [sum(samples[i].num_patches for i in s) for s in balance(samples, num_slots=4, slot_size=2)]
    assert max(loads) - min(loads) <= 1024 - 256  # greedy bound: at most one item apart


def test_loader_balances_real_micro_batches(tiny_model):
    """Across steps, per micro-batch index the replicas' vision tokens differ less than a naive deal."""
    loader = _loader(tiny_model, demo_data(), dp=2, gbs=8, mbs=2)
    for _ in range(3):
        step = next(loader)
        assert len(step.micro_batches) == 2 and all(len(row) == 2 for row in step.micro_batches)
        for row in step.micro_batches:
            loads = [b.num_patches for b in row]
            biggest = max(
                int(g.prod()) for b in row if b.image_grid_thw is not None for g in b.image_grid_thw
            )
            assert max(loads) - min(loads) <= 2 * biggest


def test_num_label_tokens_is_the_global_count(tiny_model):
    step = next(_loader(tiny_model, demo_data(), dp=2, gbs=4, mbs=2))
    expected = sum(int((b.labels[:, 1:] != -100).sum()) for row in step.micro_batches for b in row)
    assert step.num_label_tokens == expected > 0


def test_micro_batch_over_vision_seq_len_raises(tiny_model):
    loader = _loader(tiny_model, demo_data(), dp=1, gbs=4, mbs=4, vision=2048)
    with pytest.raises(
        DataError,
        match=r"micro-batch 0 of replica 0 at step 0 holds \d+ patches > modules.vision.seq_len=2048",
    ):
        for _ in range(7):
            next(loader)


def _broken_demo(demo_copy):
    """The demo JSONL plus bad lines: a missing image, a truncated JPEG, an unknown key, bad JSON."""
    (demo_copy / "images" / "grass.jpg").unlink()
    raw = (demo_copy / "images" / "clock_motion_blur.jpg").read_bytes()
    (demo_copy / "images" / "clock_motion_blur.jpg").write_bytes(raw[: len(raw) // 3])
    lines = (demo_copy / "mixed.jsonl").read_text().splitlines()  # line 2 uses grass.jpg
    lines.append(
        json.dumps(
            {
                "image": "clock_motion_blur.jpg",
                "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "moon"}],
            }
        )
    )
    lines.append(json.dumps({"oops": 1, "conversations": []}))
    lines.append("{truncated")
    path = demo_copy / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_default_policy_raises_naming_file_line_reason(tiny_model, demo_copy):
    path = _broken_demo(demo_copy)
    loader = _loader(tiny_model, jsonl_data(path, demo_copy / "images", shuffle=False), dp=1, gbs=2)
    with pytest.raises(
        bad.BadSampleError, match=rf"bad sample at {path}:2 \(missing_file\): image .*grass.jpg"
    ):
        next(loader)


def test_skip_policy_counts_by_reason_and_loses_nothing_else(tiny_model, demo_copy):
    path = _broken_demo(demo_copy)
    data = jsonl_data(path, demo_copy / "images", on_bad_sample="skip", shuffle=False)
    loader = _loader(tiny_model, data, dp=2, gbs=2)
    served = []
    for _ in range(4):  # 8 good samples: lines 1,3-7 (epoch 0; 2 and 8-10 are bad), then 1,3 of epoch 1
        step = next(loader)
        served += [sid for r in _ids(step) for sid in r]
    assert sorted(int(s.rsplit(":", 1)[1]) for s in served) == [1, 1, 3, 3, 4, 5, 6, 7]
    assert step.bad_samples == {
        "missing_file": 2,
        "corrupt_image": 1,
        "bad_conversation": 1,
        "malformed_record": 1,
    }
    log = loader.served_bad_log()  # up to step 3, whatever the prefetch thread has read since
    metrics = log.metrics()
    assert metrics["data/bad/total"] == 5 and metrics["data/bad/corrupt_image"] == 1
    assert f"{path}:8" in log.examples["corrupt_image"][0]
    assert "missing_file: 2" in log.summary()
    state = loader.state_dict()
    assert state["bad"]["counts"]["bad_conversation"] == 1


def test_all_bad_under_skip_is_an_error_not_a_hang(tiny_model, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"x": 1}\n{"y": 2}\n')
    loader = _loader(tiny_model, jsonl_data(path, tmp_path, on_bad_sample="skip"), dp=1, gbs=1)
    with pytest.raises(DataError, match="every sample of an epoch was bad"):
        next(loader)


def test_workers_and_prefetch_give_the_same_batches_and_state(tiny_model):
    a = _loader(tiny_model, demo_data(prefetch=False), dp=2, gbs=4)
    b = _loader(tiny_model, demo_data(num_workers=2, prefetch=True), dp=2, gbs=4)
    for _ in range(2):
        assert _same(next(a), next(b))
        assert a.state_dict() == b.state_dict()  # the prefetched step is not in the saved position
    assert b.state_dict()["position"] == 8 and b.position == 12  # one step built ahead
    b.close()
    assert _same(next(a), next(b))  # after close(): inline, same stream


def test_synthetic_loader_and_mixing_weights(tiny_model):
    data = DataConfig(kind="synthetic", synthetic=SyntheticData(num_samples=8, patches=64, text_tokens=8))
    step = next(_loader(tiny_model, data, dp=2, gbs=4, mbs=2))
    assert all(
        b.num_patches == 128 and b.input_ids.shape == (2, 16 + 2 + 8)
        for row in step.micro_batches
        for b in row
    )
    order = epoch_order(sizes=[4, 10], weights=[2.0, 0.5], seed=3, epoch=0, shuffle=True)
    counts = Counter(order)
    assert (
        len(order) == 8 + 5
        and all(counts[i] == 2 for i in range(4))
        and sum(counts[i] for i in range(4, 14)) == 5
    )
    weighted = demo_data()
    weighted = replace(weighted, datasets=[replace(weighted.datasets[0], weight=2.0), weighted.datasets[1]])
    assert _loader(tiny_model, weighted).epoch_len == 2 * 18 + 7


def test_bad_batch_shape_is_a_config_error(tiny_model):
    with pytest.raises(ConfigError, match=r"train\.global_batch_size"):
        _loader(tiny_model, demo_data(), dp=2, gbs=5)
    with pytest.raises(ConfigError, match=r"data\.on_bad_sample"):
        _loader(tiny_model, demo_data(on_bad_sample="ignore"))


def test_collate_pads_right_and_concatenates_images_in_order():
    a, b = _sample(64, tokens=5), _sample(0, tokens=3)
    a.pixel_values = torch.ones(64, 4)
    batch = collate([b, a], pad_token_id=7)
    assert batch.input_ids.shape == (2, 5) and batch.input_ids[0, 3:].tolist() == [7, 7]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert batch.labels[0, 3:].tolist() == [-100, -100]
    assert batch.pixel_values.shape == (64, 4) and batch.image_grid_thw.tolist() == [[1, 8, 8]]
    assert batch.sample_ids == ["s0", "s64"]


def _two_good_two_bad(tmp_path):
    """Records 0 and 1 are good demo captions; 2 and 3 name missing images."""
    turns = [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A cat."}]
    good = {"image": "cat.jpg", "conversations": turns}
    lines = [dict(good, id=f"g{i}") for i in range(2)]
    lines += [dict(good, id=f"b{i}", image=f"missing_{i}.jpg") for i in range(2)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + "\n\n")  # trailing blank lines
    return path


def test_skip_policy_counts_bad_runs_within_one_epoch_pass(tiny_model, tmp_path):
    """Seed 0 orders 4 records [0,1,3,2] (epoch 2) then [2,3,1,0] (epoch 3): with 2 and 3 bad, four bad
    records in a row span the epoch boundary; no epoch pass is all bad, so the run goes on."""
    assert epoch_order(sizes=[4], weights=[1.0], seed=0, epoch=2, shuffle=True) == [0, 1, 3, 2]
    assert epoch_order(sizes=[4], weights=[1.0], seed=0, epoch=3, shuffle=True) == [2, 3, 1, 0]
    path = _two_good_two_bad(tmp_path)
    data = jsonl_data(path, DEMO / "images", on_bad_sample="skip", prefetch=False)
    loader = _loader(tiny_model, data, dp=1, gbs=2, seed=0)
    assert loader.epoch_len == 4  # the trailing blank lines are no records
    served = [sid for _ in range(6) for sid in _ids(next(loader))[0]]
    assert sorted({int(s.rsplit(":", 1)[1]) for s in served}) == [1, 2]
    assert loader.bad_log.counts == {"missing_file": loader.position - len(served)}


def test_skipped_samples_are_named_in_the_run_dir_and_on_the_console(tiny_model, tmp_path, caplog):
    path = _two_good_two_bad(tmp_path)
    data = jsonl_data(path, DEMO / "images", on_bad_sample="skip", shuffle=False)
    loader = _loader(tiny_model, data, dp=1, gbs=2)
    out = tmp_path / "run" / "bad_samples.jsonl"
    out.parent.mkdir()
    loader.record_skipped_to(out)
    with caplog.at_level("WARNING", logger="dhp.data"):
        steps = [next(loader)]
        state0 = loader.state_dict()
        steps += [next(loader) for _ in range(2)]  # 0,1 | 2,3 bad, 0,1 | 2,3 bad, 0,1
    loader.close()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["step"], r["location"], r["reason"]) for r in rows] == [
        (2, f"{path}:3", "missing_file"),  # steps 1-based, as metrics.jsonl's
        (2, f"{path}:4", "missing_file"),
        (3, f"{path}:3", "missing_file"),
        (3, f"{path}:4", "missing_file"),
    ]
    assert "missing_0.jpg" in rows[0]["detail"]
    assert steps[0].skipped == [] and len(steps[1].skipped) == 2
    shown = [r.getMessage() for r in caplog.records if "skipped bad sample" in r.getMessage()]
    assert len(shown) == 4 and f"{path}:3 (missing_file)" in shown[0]
    # a resumed run serves steps 1..2 again: the file does not name their samples twice
    again = _loader(tiny_model, data, dp=1, gbs=2)
    again.record_skipped_to(out)
    again.load_state_dict(state0)
    next(again), next(again)
    again.close()
    assert len(out.read_text().splitlines()) == 4
    assert count_skipped(out.parent) == 4  # what `dhp runs` and `dhp report` point to
