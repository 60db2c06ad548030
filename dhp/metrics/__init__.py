"""Metrics: fixed-name JSONL records, FLOPs/MFU, peak memory, TensorBoard and the console progress."""

from dhp.metrics.flops import model_flops_per_step, palm_flops
from dhp.metrics.memory import peak_memory_bytes, reset_peak_memory
from dhp.metrics.writer import METRIC_KEYS, MetricsWriter

__all__ = [
    "METRIC_KEYS",
    "MetricsWriter",
    "model_flops_per_step",
    "palm_flops",
    "peak_memory_bytes",
    "reset_peak_memory",
]
