"""Data-side guards: each hostile input is one named bad sample (skip) or a DataError (raise)."""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import replace

import pytest
from formats_build import DEMO
from PIL import Image

from dhp.config.schema import DataConfig, DatasetEntry, TrainConfig
from dhp.data import bad
from dhp.data.check import check_data
from dhp.data.loader import build_loader

pytestmark = pytest.mark.unit
ASK = "What is in the image?"


def _rec(image: str) -> dict:
    return {
        "image": image,
        "conversations": [
            {"from": "human", "value": f"<image>\n{ASK}"},
            {"from": "gpt", "value": "A thing."},
        ],
    }


@pytest.fixture
def hostile(tmp_path):
    """A JSONL set under ``root/images``: good lines, then one line per hostile case (1-based lines)."""
    root = tmp_path / "set"
    images = root / "images"
    shutil.copytree(DEMO / "images", images)
    (images / "adir.jpg").mkdir()
    (images / "loop_a.jpg").symlink_to(images / "loop_b.jpg")
    (images / "loop_b.jpg").symlink_to(images / "loop_a.jpg")
    Image.new("1", (12000, 12000)).save(images / "bomb.png")  # 144 Mpx > PIL's 89 Mpx limit; ~20 KB
    outside = tmp_path / "outside.jpg"
    shutil.copy(DEMO / "images" / "cat.jpg", outside)
    lines = [json.dumps(_rec("cat.jpg")).encode()] * 2
    cases = {
        3: (json.dumps(_rec("../../outside.jpg")).encode(), bad.PATH_OUTSIDE_ROOT),
        4: (json.dumps(_rec(str(outside))).encode(), None),  # absolute: accepted as given
        5: (json.dumps(_rec("adir.jpg")).encode(), bad.NOT_A_FILE),
        6: (json.dumps(_rec("loop_a.jpg")).encode(), bad.SYMLINK_LOOP),
        7: (json.dumps(_rec("bomb.png")).encode(), bad.DECOMPRESSION_BOMB),
        8: (b'{"image": "cat.jpg", "conversations": "caf\xe9"}', bad.INVALID_UTF8),
        9: (b"[1, 2, 3]", bad.MALFORMED_RECORD),
    }
    lines += [line for line, _ in cases.values()]
    lines.append(json.dumps(_rec("espresso.jpg")).encode())
    path = root / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, images, {k: reason for k, (_, reason) in cases.items() if reason}


def _data(path, images, **kw) -> DataConfig:
    entry = DatasetEntry(name="h", path=str(path), image_root=str(images))
    return replace(DataConfig(kind="llava", datasets=[entry]), **kw)


def test_each_hostile_line_is_one_named_bad_sample(tiny_model, hostile):
    path, images, cases = hostile
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no raw DecompressionBombWarning may escape
        report = check_data(
            data=_data(path, images), model=tiny_model, patch_seq_len=4096, token_seq_len=2048
        )
    assert report.num_records == 10 and report.num_good == 4
    want: dict[str, int] = {}
    for reason in cases.values():
        want[reason] = want.get(reason, 0) + 1
    assert report.bad_counts == dict(sorted(want.items()))
    found = {ex.split(": ", 1)[0] for exs in report.bad_examples.values() for ex in exs}
    assert found == {f"{path}:{k}" for k in cases}
    assert any(
        "climbs out of the dataset's media root" in e for e in report.bad_examples[bad.PATH_OUTSIDE_ROOT]
    )


def test_allow_outside_root_admits_paths_elsewhere(tiny_model, hostile):
    path, images, _ = hostile
    report = check_data(
        data=_data(path, images, allow_outside_root=True),
        model=tiny_model,
        patch_seq_len=4096,
        token_seq_len=2048,
    )
    assert bad.PATH_OUTSIDE_ROOT not in report.bad_counts and report.num_good == 5


def test_restrict_media_to_refuses_every_other_root(tiny_model, hostile, tmp_path):
    """A shared cluster's allow-list: absolute and relative paths alike, symlinks resolved first."""
    path, images, _ = hostile
    (images / "escape.jpg").symlink_to(tmp_path / "outside.jpg")  # inside the root, pointing out
    lines = path.read_bytes().splitlines()
    lines.append(json.dumps(_rec("escape.jpg")).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    data = _data(path, images, restrict_media_to=[str(images)], allow_outside_root=True)
    report = check_data(data=data, model=tiny_model, patch_seq_len=4096, token_seq_len=2048)
    refused = {e.split(": ", 1)[0] for e in report.bad_examples[bad.PATH_OUTSIDE_ROOT]}
    assert refused == {f"{path}:3", f"{path}:4", f"{path}:11"}  # ../, absolute, symlink out
    assert all("restrict_media_to" in e for e in report.bad_examples[bad.PATH_OUTSIDE_ROOT])


def test_skip_trains_on_the_rest_and_raise_names_the_line(tiny_model, hostile):
    path, images, _ = hostile
    train = TrainConfig(global_batch_size=3, micro_batch_size=1)
    kw = {"model": tiny_model, "train": train, "dp_size": 1, "patch_seq_len": 4096, "token_seq_len": 2048}
    loader = build_loader(data=_data(path, images, on_bad_sample="skip", shuffle=False, prefetch=False), **kw)
    step = next(loader)
    assert [b.sample_ids[0] for mb in step.micro_batches for b in mb] == [f"{path}:{k}" for k in (1, 2, 4)]
    assert sum(step.bad_samples.values()) == 1
    loader = build_loader(data=_data(path, images, shuffle=False, prefetch=False), **kw)
    with pytest.raises(bad.BadSampleError, match=rf"bad sample at {path}:3 \(path_outside_root\)"):
        next(loader)


def test_dry_run_data_check_lists_every_missing_path(tmp_path):
    from dhp.data.preflight import check_data_paths, missing_data_paths
    from dhp.errors import DataError

    (tmp_path / "s-0000.tar").write_bytes(b"")
    ok = DataConfig(
        kind="llava",
        datasets=[
            DatasetEntry(
                name="a",
                path="pkg://dhp.data_assets/demo/captions.json",
                image_root="pkg://dhp.data_assets/demo/images",
            ),
            DatasetEntry(name="w", path=str(tmp_path / "s-{0000..0000}.tar")),
        ],
    )
    assert missing_data_paths(ok) == []
    broken = replace(
        ok,
        datasets=[
            DatasetEntry(name="a", path=str(tmp_path / "no.jsonl"), image_root=str(tmp_path / "noimg")),
            DatasetEntry(name="w", path=str(tmp_path / "s-{0000..0001}.tar")),
        ],
    )
    with pytest.raises(DataError) as info:
        check_data_paths(broken)
    text = str(info.value)
    assert "no.jsonl': does not exist (dataset a)" in text and "noimg': is not a directory" in text
    assert "s-{0000..0001}.tar': does not exist (dataset w)" in text and "Fix:" in text


def test_a_missing_eval_file_is_named_before_the_run(tmp_path):
    from dhp.config.schema import EvalDataConfig
    from dhp.data.preflight import data_path_issues

    data = DataConfig(
        kind="llava",
        datasets=[DatasetEntry(name="a", path="pkg://dhp.data_assets/demo/captions.json")],
        eval=EvalDataConfig(path=str(tmp_path / "val.json"), image_root=str(tmp_path / "noimg")),
    )
    got = {i.path: i for i in data_path_issues(data)}
    assert set(got) == {"data.eval.path", "data.eval.image_root"}
    assert "does not exist" in got["data.eval.path"].rule and "data.eval.split" in got["data.eval.path"].fix
    (tmp_path / "val.json").write_text("[]")
    (tmp_path / "noimg").mkdir()
    assert data_path_issues(data) == []
