"""FLOPs formula and the fixed-name metrics writer."""

from pathlib import Path

import pytest
import torch

from dhp.errors import RuntimeFailure
from dhp.metrics import METRIC_KEYS, MetricsWriter, llm_flops_per_step, vision_flops_per_step
from dhp.metrics.writer import read_metrics
from dhp.models import get_family

pytestmark = pytest.mark.unit

TINY = get_family("qwen2_5_vl").tiny_model_config()


def test_llm_flops_follow_palm_formula():
    a = TINY.llm
    n = a.num_layers * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256) + 128 * 1024
    assert llm_flops_per_step(arch=a, seq_lens=[10], frozen=False) == 10 * (6 * n + 12 * 2 * 128 * 10)
    assert llm_flops_per_step(arch=a, seq_lens=[10, 10], frozen=True) == pytest.approx(
        2 * llm_flops_per_step(arch=a, seq_lens=[10], frozen=False) / 3
    )


def test_vision_flops_grow_with_patches_and_drop_when_frozen():
    v = TINY.vision
    small = vision_flops_per_step(arch=v, llm_hidden=128, image_patches=[64], frozen=False)
    big = vision_flops_per_step(arch=v, llm_hidden=128, image_patches=[256], frozen=False)
    assert big > 4 * small  # linear part x4, full-attention part x16
    assert vision_flops_per_step(arch=v, llm_hidden=128, image_patches=[64], frozen=True) == pytest.approx(
        small / 3
    )


def test_writer_enforces_fixed_keys(tmp_path):
    w = MetricsWriter(tmp_path / "m.jsonl", modules=["vision", "llm"], tensorboard_dir=None)
    rec = dict.fromkeys(METRIC_KEYS, 1.0) | {
        f"{m}_{p}_s": 0.5 for m in ("vision", "llm") for p in ("fwd", "bwd", "step")
    }
    rec["peak_mem_bytes"] = {"llm/0": 10}
    w.write(rec)
    with pytest.raises(RuntimeFailure, match=r"missing \['mfu'\]"):
        w.write({k: v for k, v in rec.items() if k != "mfu"})
    w.close()
    assert read_metrics(tmp_path / "m.jsonl") == [rec]


def test_tensorboard_events_are_written_when_enabled(tmp_path):
    pytest.importorskip("tensorboard")
    w = MetricsWriter(tmp_path / "m.jsonl", modules=["llm"], tensorboard_dir=tmp_path / "tb")
    rec = dict.fromkeys(METRIC_KEYS, 1.0) | {f"llm_{p}_s": 0.5 for p in ("fwd", "bwd", "step")}
    rec |= {"step": 1, "peak_mem_bytes": {"llm/0": 10}}
    w.write(rec)
    w.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"loss", "mfu", "peak_mem_bytes/llm/0"} <= set(acc.Tags()["scalars"])
    assert [e.value for e in acc.Scalars("loss")] == [1.0]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_cpu_peak_memory_is_per_window() -> None:
    """A 256 MiB touch raises the CPU peak; after it is freed and the window reset, the peak drops."""
    from dhp.metrics.memory import peak_memory_bytes, reset_peak_memory

    cpu = torch.device("cpu")
    assert reset_peak_memory(cpu)
    before = peak_memory_bytes(cpu)
    big = torch.ones(64 * 1024 * 1024, dtype=torch.float32)  # 256 MiB, every page written
    during = peak_memory_bytes(cpu)
    del big
    assert reset_peak_memory(cpu)
    after = peak_memory_bytes(cpu)
    assert during - before >= 250 * 2**20, (before, during)
    assert during - after >= 200 * 2**20, (during, after)  # the window restarted at the current RSS
