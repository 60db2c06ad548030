"""Tiny Qwen2.5-VL checkpoints (single-file and sharded), written once per session."""

from __future__ import annotations

import pytest

from dhp.models import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_single"), sharded=False, seed=0)


@pytest.fixture(scope="session")
def tiny_sharded_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_sharded"), sharded=True, seed=0)
