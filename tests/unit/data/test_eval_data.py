"""Evaluation data (a held-out split, eval batches), chat templates and the loss mask, on the shipped
demo photos and the tiny tokenizer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import demo_data

from dhp.config.schema import EvalDataConfig
from dhp.data.batch import IGNORE_INDEX, IMAGE
from dhp.data.check import check_data
from dhp.data.eval_batches import FILL, EvalBatches
from dhp.data.holdout import held_out, split_source
from dhp.data.loader import LoaderSpec, build_loader
from dhp.data.source import build_source
from dhp.errors import ConfigError, DataError
from dhp.models.chat_templates import CHATML, QWEN2_VL

pytestmark = pytest.mark.unit
BIG = 1 << 20


def test_held_out_is_seeded_disjoint_and_leaves_training_a_record():
    a = held_out([40, 3, 1], split=0.1, seed=0)
    assert a == held_out([40, 3, 1], split=0.1, seed=0)  # the same records for the same seed
    assert a != held_out([40, 3, 1], split=0.1, seed=1)
    assert [len(h) for h in a] == [4, 1, 0]  # round(4.0); at least 1; a 1-record dataset keeps it
    assert all(0 <= i < n for h, n in zip(a, [40, 3, 1], strict=True) for i in h)


def _spec(**kw) -> LoaderSpec:
    base = {
        "dp_size": 2,
        "global_batch_size": 4,
        "micro_batch_size": 1,
        "patch_seq_len": BIG,
        "pad_token_id": 0,
        "on_bad_sample": "raise",
        "shuffle": False,
        "seed": 0,
    }
    return LoaderSpec(**(base | kw))


def test_split_keeps_eval_records_out_of_every_training_epoch(tiny_model):
    data = demo_data(eval=EvalDataConfig(split=0.25))
    source, sizes, _ = build_source(data=data, model=tiny_model, patch_seq_len=BIG, token_seq_len=BIG, seed=0)
    kept, held = split_source(source, sizes, split=0.25, seed=0)
    train_locs = {kept.location(i) for i in range(len(kept))}
    eval_locs = {held.location(i) for i in range(len(held))}
    assert not train_locs & eval_locs and len(train_locs) + len(eval_locs) == len(source)
    loader = build_loader(
        data=replace(data, shuffle=True), model=tiny_model, train=_trainer(), dp_size=1,
        patch_seq_len=BIG, token_seq_len=BIG,
    )  # fmt: skip
    seen = {
        sid
        for _ in range(2 * loader.epoch_len // 2)
        for mb in next(loader).micro_batches
        for b in mb
        for sid in b.sample_ids
    }
    assert loader.epoch_len == len(kept) and seen <= train_locs  # two epochs, never an eval record


def _trainer():
    from dhp.config.schema import TrainConfig

    return TrainConfig(global_batch_size=2, micro_batch_size=2, seed=0)


def test_eval_batches_read_each_sample_once_and_top_up_the_last_without_labels(tiny_model):
    source, _, _ = build_source(
        data=demo_data(), model=tiny_model, patch_seq_len=BIG, token_seq_len=BIG, seed=0
    )
    evals = EvalBatches(source=source, spec=_spec(), max_samples=6)  # 6 samples: 4 + 2 real + 2 copies
    for _ in range(2):  # every pass is the same
        batches = list(evals)
        ids = [sid for d in batches for mb in d.micro_batches for b in mb for sid in b.sample_ids]
        assert len(batches) == 2 and len(ids) == 8
        real = [i for i in ids if not i.endswith(FILL)]
        assert sorted(real) == sorted(source.location(i) for i in range(6))
        assert [d.metrics["eval_samples"] for d in batches] == [4.0, 2.0]
        fills = [b for mb in batches[1].micro_batches for b in mb if b.sample_ids[0].endswith(FILL)]
        assert fills and all(b.num_label_tokens == 0 for b in fills)


def test_named_chat_template_overrides_the_checkpoint_own(tiny_model):
    def first(data):
        src = build_source(data=data, model=tiny_model, patch_seq_len=BIG, token_seq_len=BIG, seed=0)[0]
        return src, src.load(0)

    src, own = first(demo_data())
    assert src.processor.tokenizer.chat_template == QWEN2_VL  # the tiny checkpoint ships Qwen2-VL's
    src, chatml = first(demo_data(chat_template="chatml"))
    assert src.processor.tokenizer.chat_template == CHATML
    text = src.processor.tokenizer.decode(chatml.input_ids)
    assert "You are a helpful assistant." not in text and own.num_tokens > chatml.num_tokens
    with pytest.raises(ConfigError, match=r"data\.chat_template = 'vicuna': unknown template"):
        first(demo_data(chat_template="vicuna"))


def test_a_checkpoint_without_a_template_names_the_fix(tiny_model, tmp_path):
    import shutil
    from pathlib import Path

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model.path, bare)
    (bare / "chat_template.jinja").unlink()
    no_template = replace(tiny_model, path=str(bare))
    with pytest.raises(DataError, match=r"no chat template .* data\.chat_template=chatml"):
        build_source(data=demo_data(), model=no_template, patch_seq_len=BIG, token_seq_len=BIG, seed=0)
    src = build_source(
        data=demo_data(chat_template="qwen2_vl"),
        model=no_template,
        patch_seq_len=BIG,
        token_seq_len=BIG,
        seed=0,
    )[0]
    assert src.load(0).num_tokens > 0 and Path(bare / "tokenizer_config.json").is_file()


def test_train_on_all_labels_every_text_token_never_an_image(tiny_model):
    def sample(train_on):
        src = build_source(
            data=demo_data(train_on=train_on), model=tiny_model, patch_seq_len=BIG, token_seq_len=BIG, seed=0
        )[0]
        return src.load(0)

    assistant, every = sample("assistant"), sample("all")
    assert torch.equal(assistant.input_ids, every.input_ids)
    text = every.mm_token_type_ids != IMAGE
    assert (every.labels[text] == every.input_ids[text]).all() and (every.labels[~text] == IGNORE_INDEX).all()
    assert 0 < assistant.num_label_tokens < every.num_label_tokens


def test_show_states_the_template_and_the_loss_mask(tiny_model):
    report = check_data(
        data=demo_data(chat_template="chatml", train_on="all"), model=tiny_model,
        patch_seq_len=BIG, token_seq_len=BIG, show=1,
    )  # fmt: skip
    head = report.shown[0].splitlines()[0]
    assert (
        "every text token, data.train_on=all" in head and "chat template: data.chat_template=chatml" in head
    )
    own = check_data(data=demo_data(), model=tiny_model, patch_seq_len=BIG, token_seq_len=BIG, show=1)
    head = own.shown[0].splitlines()[0]
    assert (
        "assistant turns only" in head and "chat template: the checkpoint's own (chat_template.jinja)" in head
    )
