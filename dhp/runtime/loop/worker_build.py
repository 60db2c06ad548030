"""Building one module rank: its device, mesh, module (loaded from ``model.path`` or a seeded
random init), parallelism, trainable parameters and optimizer; the hand-off channel's connect.

A mixin of :class:`dhp.runtime.loop.worker.ModuleWorker` (its attributes set in ``__init__``: ``spec``,
``layout``, ``model_cfg``, ``module_cfg``, ``train_cfg``, ``channel``, ``frozen``). Memory: this
rank's shard of the module, its gradients and optimizer state (see :meth:`BuildMethods.build`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dhp import parallel as par
from dhp.metrics.record import module_kernels
from dhp.models import get_family
from dhp.models.dtypes import torch_dtype
from dhp.models.loading import LoadReport, load_module_weights
from dhp.ops.linear_attn import require_kernel
from dhp.parallel.lora import apply_lora, init_lora_params
from dhp.runtime.actors.dispatch import Collect, Dispatch, register

#: seed offset per module so vision and llm draw different random inits from one train.seed
_SEED_STRIDE = 1_000_003


class BuildMethods:
    """Build and load one module's shard on this rank (see the module docstring)."""

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def build(self) -> int:
        """Mesh over this group's world, the module (loaded or seeded init), parallelism, optimizer.

        Precision (``modules.<name>.mixed_precision``, :mod:`dhp.parallel.precision`): the
        parameters are stored in the policy's parameter dtype whatever ``model.dtype`` the weights
        come in (fp32 master weights under ``bf16_master_fp32``: a bf16 checkpoint is upcast as it
        is read, a random init drawn in ``model.dtype`` is cast), so the gradients and AdamW states
        are that dtype too; ``parallelize`` makes the module compute in the policy's compute dtype,
        and the rows handed to the next module travel in it (bf16 under both bf16 policies).

        ``model.path`` set: the module is built on ``meta`` (no memory), parallelized there (TP/SP
        swap styles and forwards, AC, FSDP2's ``fully_shard``), then only this rank's storage is
        materialised on its device (``to_empty``) and filled from the safetensors files with this
        rank's slices (a TP or FSDP rank reads ~1/degree of the sharded tensors, see
        :attr:`load_report`); the rotary ``inv_freq`` buffers are recomputed by the family. Peak
        memory: this rank's shard, never the full module.

        ``model.path`` null: random init builds the FULL module on every rank's device from
        ``train.seed`` and only then shards it, so every plan starts from identical weights. That
        costs the whole module's parameters (in ``model.dtype``, then the parameter dtype) on each
        rank until ``parallelize`` frees the non-local parts: fine for tiny/benchmark models, not for
        real sizes (use a path). Returns the number of parameters.
        """

        cuda = self.device_type == "cuda"  # init_dist already selected Ray's GPU
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        # the kernels this process will run; the plan counted the planned linear-attention kernel
        # (dhp.ops.linear_attn.planned_kernel): any other one is refused here, before anything is built
        self.kernels = module_kernels(self.model_cfg, module=self.module_name, device_type=self.device.type)
        if self.kernels.get("linear_attention"):
            require_kernel(self.device.type)
        self.mesh = par.build_mesh(self.layout, self.device_type)
        family = self.family = get_family(self.model_cfg.family)
        precision = self.precision = par.precision_of(self.module_cfg.mixed_precision)
        par.check_device_computes(precision, self.device, module_name=self.module_name)
        dtype = torch_dtype(self.model_cfg.dtype)  # what the weights come in; stored as precision's
        self.module: nn.Module = self._build_module(family, dtype=dtype)
        self.expert_load = _track_expert_load(self.module, tp=self.layout.tp)
        if not self.frozen:  # freeze_patterns / LoRA: requires_grad per parameter, after parallelize
            par.apply_trainable(
                self.module, module_name=self.module_name, module_cfg=self.module_cfg, lr=self.train_cfg.lr
            )
        self.optimizer = (
            None
            if self.frozen
            else par.build_optimizer(
                self.module,
                self.mesh,
                self.layout,
                train=self.train_cfg,
                param_groups=self.module_cfg.param_groups,
            )
        )
        torch.manual_seed(self.train_cfg.seed + self.rank)  # per-rank stream for dropout & co.
        return sum(p.numel() for p in self.module.parameters())

    def _build_module(self, family: Any, *, dtype: torch.dtype) -> nn.Module:
        """This rank's parallelized module: a seeded random init built whole on the device and then
        sharded (``model.path`` null), or built on ``meta``, parallelized there and filled with this
        rank's slices of ``model.path`` (see :meth:`build`); sets ``hf_config`` and ``load_report``."""
        precision = self.precision
        self.load_report: LoadReport | None = None
        if self.model_cfg.path is None:
            hf_config = self.hf_config = family.hf_config(self.model_cfg)
            torch.manual_seed(
                self.train_cfg.seed + _SEED_STRIDE * family.module_names.index(self.module_name)
            )
            module = family.build_module(self.module_name, hf_config, device=self.device, dtype=dtype)
            self.module = self._parallelize(module)
        else:
            hf_config = self.hf_config = family.hf_config_from_dir(
                self.model_cfg.path, attn_implementation=self.model_cfg.attn_implementation
            )
            module = family.build_module(self.module_name, hf_config, device="meta", dtype=dtype)
            self.module = self._parallelize(module)  # on meta: DTensor shards know their local slice
            self.load_report = load_module_weights(
                self.module,
                self.model_cfg.path,
                family=family,
                module_name=self.module_name,
                hf_config=hf_config,
                dtype=precision.param_dtype,
                device=self.device,
            )
            init_lora_params(self.module, seed=self.train_cfg.seed)  # adapters are not in model.path
        return self.module

    def _parallelize(self, module: nn.Module) -> nn.Module:
        """Freeze when configured, then apply this module's strategies (real or meta parameters)."""
        if self.frozen:
            module.requires_grad_(False)
        else:  # LoRA adapters (peft) before any parallelism; TP shards them like their base layer
            module = apply_lora(module, module_name=self.module_name, lora=self.module_cfg.lora)
        par.cast_parameters_(module, self.precision.param_dtype)  # free on meta
        return par.parallelize(
            self.module_name,
            module,
            self.mesh,
            self.layout,
            activation_checkpointing=self.module_cfg.activation_checkpointing,
            mixed_precision=self.module_cfg.mixed_precision,
            loss_chunk_tokens=self.loss_chunk_tokens,
        )

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def load_stats(self) -> dict[str, Any] | None:
        """This rank's weight load from ``model.path`` (keys, files, bytes read); None for random init."""
        r = self.load_report
        if r is None:
            return None
        return {
            "keys_read": list(r.keys_read),
            "files_opened": list(r.files_opened),
            "bytes_read": r.bytes_read,
        }

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def connect_channel(self, *, host: str, port: int, backend: str, timeout_s: float) -> None:
        """Join what the hand-off channel needs (the bridge's communicators: every rank of every group,
        blocking until all joined; nothing for the object store or CUDA IPC)."""
        self.channel.connect(host=host, port=port, backend=backend, timeout_s=timeout_s)


def _track_expert_load(module: nn.Module, *, tp: int) -> par.ExpertLoad | None:
    """Per-layer tokens-per-expert counters on the family's MoE blocks (None: the module has none)."""
    plan = par.module_plan(module)
    if not plan.moe_blocks:
        return None
    return par.track_expert_load(module, plan.moe_blocks, duplicates=tp, num_experts=plan.experts)
