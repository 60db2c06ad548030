"""Allowed names for string-valued config fields (one place, so validation and docs agree)."""

from __future__ import annotations

from dhp.layout import PARALLEL_AXES as PARALLEL_AXES  # mesh order, outer -> inner (dhp.layout)

DTYPES = ("float32", "bfloat16")
ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")
DEVICES = ("cuda", "cpu")
MIXED_PRECISIONS = ("bf16_master_fp32", "bf16", "fp32")
PLACEMENTS = ("collocated", "disaggregated")
HANDOFFS = ("auto", "object_store", "cuda_ipc", "p2p")
MODULE_NAMES = ("vision", "llm")
REQUIRED_MODULES = ("vision", "llm")
DATA_KINDS = ("llava", "synthetic")
DATA_ENGINES = ("local", "ray")
DATASET_FORMATS = ("auto", "llava", "messages", "parquet", "webdataset")
BAD_SAMPLE_POLICIES = ("raise", "skip")
