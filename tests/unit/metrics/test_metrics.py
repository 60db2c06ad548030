"""FLOPs formula and the fixed-name metrics writer."""

from pathlib import Path

import pytest
import torch

from dhp.errors import RuntimeFailure
from dhp.metrics import METRIC_KEYS, MetricsWriter, model_flops_per_step, palm_flops
from dhp.metrics.writer import read_metrics
from dhp.models import get_arch, get_family

pytestmark = pytest.mark.unit

TINY = get_family("qwen2_5_vl").tiny_model_config()
ARCH = get_arch("qwen2_5_vl").architecture(TINY)


def test_llm_flops_follow_palm_formula():
    a = ARCH.modules["llm"]
    n = 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256) + 128 * 1024  # 2 layers + lm_head
    assert palm_flops(a, [10], frozen=False) == 10 * (6 * n + 12 * 2 * 128 * 10)
    assert palm_flops(a, [10, 10], frozen=True) == pytest.approx(2 * palm_flops(a, [10], frozen=False) / 3)


def test_vision_flops_grow_with_patches_and_drop_when_frozen():
    v = ARCH.modules["vision"]
    small = palm_flops(v, [64], frozen=False)
    big = palm_flops(v, [256], frozen=False)
    assert big > 4 * small  # linear part x4, full-attention part x16
    assert palm_flops(v, [64], frozen=True) == pytest.approx(small / 3)


def test_qwen3_vl_mfu_counts_every_encoder_block_as_full_attention():
    """The measured MFU reads the family's typed blocks: 27 full-attention blocks, no windows."""
    from omegaconf import OmegaConf

    from dhp.config.loader import CONF_DIR

    model = OmegaConf.load(CONF_DIR / "model" / "qwen3_vl_8b.yaml")
    frozen = {"vision": False, "llm": True}
    v = get_arch("qwen3_vl").architecture(model).modules["vision"]
    assert v.count("full") == v.layers == 27
    one, four = (
        model_flops_per_step(model, image_patches=[p], seq_lens=[], frozen=frozen) for p in (1024, 4096)
    )
    # attention grows with the whole image in every block: more than 4x for 4x the patches
    n = v.block_macs() + v.head_macs + v.input_row * v.hidden
    assert four - 4 * one == pytest.approx(12 * v.hidden * 27 * (4096**2 - 4 * 1024**2))
    assert one == pytest.approx(1024 * (6 * n + 12 * v.hidden * 27 * 1024))


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
