"""Data layer: LLaVA datasets, sample processing (the model family's processor), synthetic samples, the step loader, the check.

Public API:
- :class:`~dhp.data.batch.VLBatch`, :class:`~dhp.data.batch.Sample`, :func:`~dhp.data.batch.collate`
- :func:`~dhp.data.loader.build_loader` -> :class:`~dhp.data.loader.StepLoader` yielding
  :class:`~dhp.data.loader.StepData` (``micro_batches[m][r]``, ``num_label_tokens``);
  :func:`~dhp.data.loader.build_run_loader` derives its arguments from a whole ``RunConfig``;
  :func:`~dhp.data.eval_batches.build_run_data` adds the eval batches (``data.eval``)
- :func:`~dhp.data.check.check_data` -> :class:`~dhp.data.check.DataReport` (``dhp data check``)
- :class:`~dhp.data.bad.BadSampleError`, :class:`~dhp.data.bad.BadSampleLog`
"""

from dhp.data.bad import BadSampleError, BadSampleLog
from dhp.data.batch import Sample, VLBatch, collate
from dhp.data.eval_batches import EvalBatches, build_run_data
from dhp.data.loader import LoaderSpec, StepData, StepLoader, build_loader, build_run_loader

__all__ = [
    "BadSampleError",
    "BadSampleLog",
    "EvalBatches",
    "LoaderSpec",
    "Sample",
    "StepData",
    "StepLoader",
    "VLBatch",
    "build_loader",
    "build_run_data",
    "build_run_loader",
    "collate",
]
