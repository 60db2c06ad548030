"""Allowed names for string-valued config fields (one place, so validation and docs agree)."""

from __future__ import annotations

from dhp.layout import PARALLEL_AXES as PARALLEL_AXES  # mesh order, outer -> inner (dhp.layout)

DTYPES = ("float32", "bfloat16")
ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")
DEVICES = ("cuda", "cpu")
MIXED_PRECISIONS = ("bf16_master_fp32", "bf16", "fp32")
# torch's AdamW implementations (``train.optimizer.impl``): one fused kernel per step, multi-tensor
# ops over the parameter list, or a Python loop over the parameters (``dhp.parallel.optim``)
OPTIMIZER_IMPLS = ("fused", "foreach", "for_loop")
# devices whose torch build runs AdamW(fused=True): CUDA, and CPU since torch 2.4 (the pinned 2.13
# lists both in torch.utils._foreach_utils._get_fused_kernels_supported_devices)
FUSED_OPTIMIZER_DEVICES = ("cuda", "cpu")
# ``train.router_aux_loss``: a term defined on a batch (an MoE router's load-balancing loss) over the
# step's batch, as transformers on the whole batch in one call (a statistics pass first when a replica
# has several micro-batches), or over each micro-batch's tokens (no pass; the objective then depends on
# train.micro_batch_size and on dp vs gradient accumulation)
ROUTER_AUX_LOSS_MODES = ("step", "micro_batch")
PLACEMENTS = ("collocated", "disaggregated")  # the named forms; or a partition a+b/c (dhp.config.placement)
HANDOFFS = ("auto", "object_store", "cuda_ipc", "p2p")
#: the modules of a vision-language family, for messages before the model's family is known (each
#: family declares its own: ``FamilyArch.module_names``)
MODULE_NAMES = ("vision", "llm")
DATA_KINDS = ("llava", "synthetic")
DATA_ENGINES = ("local", "ray")
DATASET_FORMATS = ("auto", "llava", "messages", "parquet", "webdataset")
BAD_SAMPLE_POLICIES = ("raise", "skip")
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")  # dhp.runtime.loop.schedule
RESUME_HORIZONS = ("keep", "new")  # train.resume_horizon
TRAIN_ON = ("assistant", "all")  # data.train_on: the tokens that carry the loss
CHAT_TEMPLATE_OWN = "checkpoint"  # data.chat_template: model.path's own template
