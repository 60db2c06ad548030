"""Fixtures for data tests: a tiny tokenizer/preprocessor directory and the shipped demo set."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from dhp.config.schema import DataConfig, DatasetEntry, ModelConfig

DEMO = Path(__file__).resolve().parents[3] / "dhp" / "data_assets" / "demo"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> ModelConfig:
    """The tiny model config with ``path`` = a complete tiny HF directory (tokenizer, chat template,
    preprocessor config) written by the models layer's ``make_tiny_checkpoint``."""
    from dhp.models import get_family, make_tiny_checkpoint

    out = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"))
    return replace(get_family("qwen2_5_vl").tiny_model_config(), path=str(out))


def demo_data(**overrides) -> DataConfig:
    """The shipped demo set (both files), as conf/data/demo.yaml configures it."""
    data = DataConfig(
        kind="llava",
        datasets=[
            DatasetEntry(
                name="demo_captions",
                path="pkg://dhp.data_assets/demo/captions.json",
                image_root="pkg://dhp.data_assets/demo/images",
            ),
            DatasetEntry(
                name="demo_mixed",
                path="pkg://dhp.data_assets/demo/mixed.jsonl",
                image_root="pkg://dhp.data_assets/demo/images",
            ),
        ],
        min_pixels=56 * 56,
        max_pixels=448 * 448,
    )
    return replace(data, **overrides)


@pytest.fixture
def demo_copy(tmp_path) -> Path:
    """A writable copy of the demo set (to delete, truncate or edit files)."""
    dst = tmp_path / "demo"
    shutil.copytree(DEMO, dst)
    return dst


def jsonl_data(path: Path, image_root: Path, **overrides) -> DataConfig:
    """A one-dataset DataConfig over ``path``."""
    entry = DatasetEntry(name="t", path=str(path), image_root=str(image_root))
    return replace(DataConfig(kind="llava", datasets=[entry]), **overrides)
