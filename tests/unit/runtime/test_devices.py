"""Device selection when every actor sees all GPUs of its node (``dhp.runtime.launch.devices``)."""

from __future__ import annotations

import pytest

from dhp.errors import RuntimeFailure
from dhp.runtime.actors.actor_group import WORKER_ENV
from dhp.runtime.launch.devices import local_cuda_index

pytestmark = pytest.mark.unit


def test_physical_ids_without_a_visible_list() -> None:
    assert local_cuda_index([3], None) == 3
    assert local_cuda_index(["5"], "") == 5


def test_ids_are_positions_in_the_nodes_visible_list() -> None:
    # the node was started with CUDA_VISIBLE_DEVICES=4,6: Ray says "6", torch calls it cuda:1
    assert local_cuda_index(["6"], "4,6") == 1
    assert local_cuda_index(["GPU-aa"], "GPU-bb, GPU-aa") == 1  # UUID lists too


def test_missing_gpu_is_a_clear_error() -> None:
    with pytest.raises(RuntimeFailure, match="without a GPU"):
        local_cuda_index([], None)
    with pytest.raises(RuntimeFailure, match="does not list it"):
        local_cuda_index(["7"], "0,1")


def test_actors_keep_every_gpu_visible() -> None:
    # CUDA IPC between collocated ranks on different GPUs needs both devices visible to the reader
    assert WORKER_ENV["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
