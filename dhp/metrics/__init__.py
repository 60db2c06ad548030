"""Metrics: fixed-name JSONL records, FLOPs/MFU, peak memory, TensorBoard and the console progress."""

from dhp.metrics.flops import llm_flops_per_step, vision_flops_per_step
from dhp.metrics.memory import peak_memory_bytes, reset_peak_memory
from dhp.metrics.writer import METRIC_KEYS, MetricsWriter

__all__ = [
    "METRIC_KEYS",
    "MetricsWriter",
    "llm_flops_per_step",
    "peak_memory_bytes",
    "reset_peak_memory",
    "vision_flops_per_step",
]
