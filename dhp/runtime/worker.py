"""ModuleWorker: one rank of one module (vision encoder or LLM) inside its actor group.

Placement and memory per rank: the module's shard after ``dhp.parallel.parallelize`` (TP: 1/tp of
the LLM's matrices; SP: a full encoder copy with 1/sp of the activations), its gradients and
optimizer state (none when ``freeze``), and the activations of at most two micro-batches in
flight (the encoder runs micro-batch i+1 while the LLM works on i). Every public method declares
its dispatch/collect contract; the driver (``dhp.runtime.driver``) is the only caller.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import ray
import torch
import torch.distributed as dist
from torch import nn

from dhp import parallel as par
from dhp.config.schema import ModelConfig, ModuleConfig, TrainConfig
from dhp.data.batch import VLBatch
from dhp.data.remote import resolve_pixels
from dhp.errors import RuntimeFailure
from dhp.metrics import accounting
from dhp.metrics.memory import peak_memory_bytes, reset_peak_memory
from dhp.models import get_family
from dhp.models.loading import LoadReport, load_module_weights
from dhp.models.qwen2_5_vl.family import torch_dtype
from dhp.parallel.lora import apply_lora, init_lora_params
from dhp.parallel.ulysses import vision_shard_forward
from dhp.runtime.base_worker import DistWorker
from dhp.runtime.bridge import Bridge, BridgeLayout
from dhp.runtime.dispatch import Collect, Dispatch, register
from dhp.runtime.handoff import VisionWork
from dhp.runtime.transport import make_transport

#: seed offset per module so vision and llm draw different random inits from one train.seed
_SEED_STRIDE = 1_000_003


class ModuleWorker(DistWorker):
    """Build, run and update one module's shard on this rank (see module docstring)."""

    def __init__(
        self,
        *,
        module_name: str,
        rank: int,
        world_size: int,
        model: ModelConfig,
        module: ModuleConfig,
        train: TrainConfig,
        mesh: dict[str, int],
        device: str,
        handoff: str,
        num_llm_replicas: int,
        num_vision_units: int,
        bridge_layout: BridgeLayout | None = None,
        loss_chunk_tokens: int = 0,
    ) -> None:
        super().__init__(module_name=module_name, rank=rank, world_size=world_size)
        self.model_cfg, self.module_cfg, self.train_cfg = model, module, train
        self.mesh_shape = dict(mesh)
        self.device_type = device
        self.transport = make_transport(handoff)
        self.bridge_layout = bridge_layout
        self.bridge: Bridge | None = None  # p2p only, after init_bridge
        self.num_llm_replicas = num_llm_replicas
        self.num_vision_units = num_vision_units
        self.frozen = module.freeze
        # the plan's resolved loss chunk (the config's value, or the planner's choice when it is 0)
        self.loss_chunk_tokens = loss_chunk_tokens or module.loss_chunk_tokens
        self._inflight: dict[int, tuple[torch.Tensor, VisionWork]] = {}
        # handoff_bytes: image-embedding bytes this rank copied out of the hand-off (LLM ranks)
        self._timers = {"fwd_s": 0.0, "bwd_s": 0.0, "step_s": 0.0, "wait_s": 0.0, "handoff_bytes": 0.0}
        self._events: list[tuple[str, int, float, float]] = []  # (method, micro-batch, start, end) wall clock
        self._acct = accounting.from_env(lambda: self.module, lambda: self.optimizer)  # opt-in

    # ---- build -----------------------------------------------------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def build(self) -> int:
        """Mesh over this group's world, the module (loaded or seeded init), parallelism, optimizer.

        ``model.path`` set: the module is built on ``meta`` (no memory), parallelized there (TP/SP
        swap styles and forwards, AC, FSDP2's ``fully_shard``), then only this rank's storage is
        materialised on its device (``to_empty``) and filled from the safetensors files with this
        rank's slices (a TP or FSDP rank reads ~1/degree of the sharded tensors, see
        :attr:`load_report`); the rotary ``inv_freq`` buffers are recomputed by the family. Peak
        memory: this rank's shard, never the full module.

        ``model.path`` null: random init builds the FULL module on every rank's device from
        ``train.seed`` and only then shards it, so every plan starts from identical weights. That
        costs the whole module's parameters (in ``model.dtype``) on each rank until ``parallelize``
        frees the non-local parts: fine for tiny/benchmark models, not for real sizes (use a path).
        Returns the number of parameters.
        """
        from torch.distributed.device_mesh import init_device_mesh

        cuda = self.device_type == "cuda"  # init_dist already selected Ray's GPU
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.mesh = init_device_mesh(
            self.device_type, tuple(self.mesh_shape.values()), mesh_dim_names=tuple(self.mesh_shape)
        )
        family = get_family(self.model_cfg.family)
        dtype = torch_dtype(self.model_cfg.dtype)
        self.load_report: LoadReport | None = None
        if self.model_cfg.path is None:
            hf_config = family.hf_config(self.model_cfg)
            torch.manual_seed(
                self.train_cfg.seed + _SEED_STRIDE * family.module_names.index(self.module_name)
            )
            module = family.build_module(self.module_name, hf_config, device=self.device, dtype=dtype)
            self.module: nn.Module = self._parallelize(module)
        else:
            hf_config = family.hf_config_from_dir(
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
                dtype=dtype,
                device=self.device,
            )
            init_lora_params(self.module, seed=self.train_cfg.seed)  # adapters are not in model.path
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
                parallel=self.module_cfg.parallel,
                train=self.train_cfg,
                param_groups=self.module_cfg.param_groups,
            )
        )
        torch.manual_seed(self.train_cfg.seed + self.rank)  # per-rank stream for dropout & co.
        return sum(p.numel() for p in self.module.parameters())

    def _parallelize(self, module: nn.Module) -> nn.Module:
        """Freeze when configured, then apply this module's strategies (real or meta parameters)."""
        if self.frozen:
            module.requires_grad_(False)
        else:  # LoRA adapters (peft) before any parallelism; TP shards them like their base layer
            module = apply_lora(module, module_name=self.module_name, lora=self.module_cfg.lora)
        return par.parallelize(
            self.module_name,
            module,
            self.mesh,
            parallel=self.module_cfg.parallel,
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
    def init_bridge(self, *, host: str, port: int, backend: str, timeout_s: float) -> None:
        """Join the p2p hand-off bridge (both groups' ranks; blocks until all joined)."""
        assert self.bridge_layout is not None
        self.bridge = Bridge(
            host=host,
            port=port,
            rank=self.bridge_layout.bridge_rank(self.module_name, self.rank),
            world_size=self.bridge_layout.world_size,
            backend=backend,
            timeout_s=timeout_s,
        )

    # ---- vision ----------------------------------------------------------------------------
    @register(dispatch=Dispatch.PER_RANK, collect=Collect.ALL)
    def vision_forward(self, work: VisionWork, micro_batch: int, send: bool) -> Any:
        """Encode this rank's SP shard; return one payload per LLM replica (``num_returns``).

        A payload is ``(rows, dst_index)`` (zero-copy views for the object store) or None when no
        row of this rank goes to that replica, or when ``send`` is False (TP ranks > 0 of a vision
        unit hold the same rows as its rank 0). Activations stay here until ``vision_backward``.
        """
        t0, wall = time.perf_counter(), time.time()
        payloads: list[Any] = [None] * self.num_llm_replicas
        if work.shard is not None:
            with torch.set_grad_enabled(not self.frozen):
                shard = resolve_pixels(work.shard)  # data.engine=ray: rows come from the object store
                with accounting.saving(self._acct):
                    out = vision_shard_forward(self.module, _shard_to(shard, self.device))
            if not self.frozen:
                self._inflight[micro_batch] = (out, work)
            for route in work.routes if send else ():
                rows = out.detach()[route.src.to(self.device)]
                if self.bridge is not None:  # p2p: straight to the LLM replica's leader
                    dst = self.bridge_layout.llm_leader(route.llm_replica)
                    rows = rows.to(torch_dtype(self.model_cfg.dtype))
                    self.bridge.send(rows, dst=dst, direction="fwd", tag=micro_batch)
                else:
                    payloads[route.llm_replica] = (self.transport.pack(rows), route.dst.numpy())
        self._timers["fwd_s"] += time.perf_counter() - t0
        self._events.append(("vision_forward", micro_batch, wall, time.time()))
        return payloads[0] if self.num_llm_replicas == 1 else tuple(payloads)

    @register(dispatch=Dispatch.PER_RANK, collect=Collect.NONE)
    def vision_backward(self, micro_batch: int, grad_refs: list[Any]) -> None:
        """Backpropagate the LLM's gradient rows for this rank's output (one ref per LLM replica)."""
        entry = self._inflight.pop(micro_batch, None)
        if entry is None or self.frozen:
            return
        out, work = entry
        t0 = time.perf_counter()
        if self.bridge is not None:
            grad = self._recv_vision_grad(out, work, micro_batch)
            self._timers["wait_s"] += time.perf_counter() - t0
            t1 = time.perf_counter()
        else:
            grads = ray.get(grad_refs) if grad_refs else []
            self._timers["wait_s"] += time.perf_counter() - t0
            t1 = time.perf_counter()
            grad = torch.zeros_like(out)
            by_replica = {r.llm_replica: r for r in work.routes}
            for j, payload in enumerate(grads):
                if payload is not None:
                    grad[by_replica[j].src.to(self.device)] = self.transport.unpack(
                        payload, device=self.device
                    )
        out.backward(grad)
        accounting.sample(self._acct)
        self._timers["bwd_s"] += time.perf_counter() - t1

    def _recv_vision_grad(self, out: torch.Tensor, work: VisionWork, micro_batch: int) -> torch.Tensor:
        """p2p: the unit leader receives its rows' gradients from each LLM replica leader it fed,
        then (vision TP) broadcasts the whole gradient to the unit's other TP ranks."""
        grad = torch.zeros_like(out)
        tp_group = _inner_group(self.mesh, self.mesh_shape, ("tp",))
        if _is_root(tp_group):
            for route in work.routes:
                g = self.bridge.recv(
                    (route.src.numel(), out.shape[1]),
                    dtype=torch_dtype(self.model_cfg.dtype),
                    device=self.device,
                    src=self.bridge_layout.llm_leader(route.llm_replica),
                    direction="bwd",
                    tag=micro_batch,
                )
                grad[route.src.to(self.device)] = g.to(grad.dtype)
        if tp_group is not None and work.routes:
            dist.broadcast(grad, group=tp_group, group_src=0)
        return grad

    # ---- llm -------------------------------------------------------------------------------
    @register(dispatch=Dispatch.SHARD_BY_DP, collect=Collect.DP_LEADERS)
    def llm_forward_backward(
        self,
        batch: VLBatch,
        chunk_refs: list[Any],
        recv_from: list[tuple[int, Any]],
        *,
        micro_batch: int,
        num_label_tokens: int,
        vision_grads: bool,
    ) -> Any:
        """Forward + backward of one micro-batch with ``loss_sum / T``; returns stats and grad payloads.

        ``chunk_refs``: one ref per vision unit (None where it sends nothing); with the p2p hand-off
        it is empty and ``recv_from`` lists ``(vision bridge rank, dst rows)`` to receive. Returns
        ``(stats, grad_0, ..., grad_{U-1})`` with ``num_returns = 1 + U`` when ``vision_grads``,
        else ``stats`` (always ``stats`` with p2p: the grads go back over the bridge). Only the
        replica's leader sends gradient rows (TP ranks hold identical ones).
        """
        t0, wall = time.perf_counter(), time.time()
        if self.bridge is not None:
            group = _inner_group(self.mesh, self.mesh_shape, ("sp", "tp"))  # the replica's other ranks
            arrivals = self._bridge_arrivals(recv_from, micro_batch) if _is_root(group) else None
            embeds = self._assemble(batch, arrivals, requires_grad=vision_grads, broadcast_in=group)
        else:
            got = ray.get([ref for ref in chunk_refs if ref is not None])
            sources = [r for r, ref in enumerate(chunk_refs) if ref is not None]
            chunks = [(r, p) for r, p in zip(sources, got, strict=True) if p is not None]
        wait, wall = time.perf_counter() - t0, time.time()  # the LLM event starts after its inputs arrived
        self._timers["wait_s"] += wait
        t1 = time.perf_counter()
        if self.bridge is None:
            arrivals = ((dst, self.transport.unpack(rows, device=self.device)) for _, (rows, dst) in chunks)
            embeds = self._assemble(batch, arrivals, requires_grad=vision_grads)
        with torch.set_grad_enabled(True), accounting.saving(self._acct):
            out = self.module(
                input_ids=batch.input_ids.to(self.device),
                attention_mask=batch.attention_mask.to(self.device),
                labels=batch.labels.to(self.device),
                mm_token_type_ids=batch.mm_token_type_ids.to(self.device),
                image_grid_thw=None if batch.image_grid_thw is None else batch.image_grid_thw.to(self.device),
                image_embeds=embeds,
                sample_ids=batch.sample_ids,
                **_video_kwargs(batch, self.device),
            )
        t2 = time.perf_counter()
        self._timers["fwd_s"] += t2 - t1
        loss = out.loss_sum / num_label_tokens
        if loss.requires_grad:
            loss.backward()
            accounting.sample(self._acct)
        self._timers["bwd_s"] += time.perf_counter() - t2
        self._events.append(("llm_forward_backward", micro_batch, wall, time.time()))
        stats = {"loss_sum": float(out.loss_sum.detach()), "num_tokens": int(out.num_tokens), "wait_s": wait}
        if not vision_grads:
            return stats
        leader = self.rank % (self.mesh_shape.get("sp", 1) * self.mesh_shape.get("tp", 1)) == 0
        if self.bridge is not None:  # p2p: the leader sends each source its rows' grads; stats only
            for src, dst in recv_from if leader and embeds is not None else ():
                rows = embeds.grad[torch.from_numpy(dst).to(self.device)]
                self.bridge.send(rows, dst=src, direction="bwd", tag=micro_batch)
            return stats
        grads: list[Any] = [None] * self.num_vision_units
        if leader and embeds is not None:
            for r, (_, dst) in chunks:
                grads[r] = self.transport.pack(embeds.grad[torch.from_numpy(dst).to(self.device)])
        return (stats, *grads)

    def _bridge_arrivals(
        self, recv_from: list[tuple[int, Any]], micro_batch: int
    ) -> Iterator[tuple[Any, torch.Tensor]]:
        """p2p: ``(dst rows, received rows)`` from each source in ``recv_from`` order, received lazily."""
        dtype = torch_dtype(self.model_cfg.dtype)
        for src, dst in recv_from:
            shape = (len(dst), self.model_cfg.llm.hidden_size)
            yield (
                dst,
                self.bridge.recv(
                    shape, dtype=dtype, device=self.device, src=src, direction="fwd", tag=micro_batch
                ),
            )

    def _assemble(
        self,
        batch: VLBatch,
        arrivals: Iterable[tuple[Any, torch.Tensor]] | None,
        *,
        requires_grad: bool,
        broadcast_in: Any = None,
    ) -> torch.Tensor | None:
        """Place the arriving ``(dst rows, rows)`` at their token positions; a leaf that collects the
        embeds' grad. ``arrivals`` None: this rank receives the whole tensor by a broadcast from rank
        0 of ``broadcast_in`` (p2p: only the replica leader talks to the bridge)."""
        if batch.image_grid_thw is None:
            return None
        n = int(batch.image_grid_thw.prod(dim=1).sum()) // self.model_cfg.vision.spatial_merge_size**2
        embeds = torch.zeros(
            n, self.model_cfg.llm.hidden_size, dtype=torch_dtype(self.model_cfg.dtype), device=self.device
        )
        if arrivals is not None:
            filled = 0
            # p2p: the replica leader receives every row and broadcasts them to its TP peers
            own = self._own_rows(batch) if broadcast_in is None else None
            for dst, rows in arrivals:
                filled += len(dst)
                dst = torch.from_numpy(dst)
                if own is not None:  # sequence parallel: copy only the rows of this rank's shard
                    keep = own[dst]
                    dst, rows = dst[keep], rows[keep.to(rows.device)]
                embeds[dst.to(self.device)] = rows.to(embeds.dtype)
                self._timers["handoff_bytes"] += rows.numel() * rows.element_size()
            if filled != n:
                raise RuntimeFailure(
                    f"module 'llm' rank {self.rank}: hand-off delivered {filled} image-embedding rows, "
                    f"the micro-batch {batch.sample_ids} has {n} image tokens (a routing bug)"
                )
        if broadcast_in is not None:
            dist.broadcast(embeds, group=broadcast_in, group_src=0)
        return embeds.requires_grad_(requires_grad)

    def _own_rows(self, batch: VLBatch) -> torch.Tensor | None:
        """Sequence parallelism inside TP: a bool mask over the micro-batch's image-embedding rows, True
        for the rows whose tokens fall into this TP rank's sequence shard (the only rows the LLM reads
        here; the rest are cut away before layer 0). None without SP: every row is needed."""
        par_cfg = self.module_cfg.parallel
        if not (par_cfg.sequence_parallel and par_cfg.tp > 1):
            return None
        return par.sequence_shard_rows(
            batch.input_ids,
            (self.model_cfg.tokens.image_token_id, self.model_cfg.tokens.video_token_id),
            tp=par_cfg.tp,
            rank=self.mesh["tp"].get_local_rank(),
        )

    # ---- optimizer -------------------------------------------------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def finalize_grads(self) -> float:
        """Reduce grads over SP/DP (sums) and return the module's squared grad norm (same on all ranks)."""
        if self.bridge is not None:
            self.bridge.drain()  # every backward ran: each send has been received
        if self.frozen:
            return 0.0
        t0 = time.perf_counter()
        par.finalize_grads(self.module, self.mesh, parallel=self.module_cfg.parallel)
        norm_sq = float(par.grad_norm_sq(self.module, self.mesh))
        self._timers["step_s"] += time.perf_counter() - t0
        return norm_sq

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def optimizer_step(self, *, lr: float, clip_coef: float) -> None:
        """Scale grads by ``clip_coef`` (< 1 when clipping), AdamW step at ``lr``, zero the grads."""
        if self.transport is not None:
            self.transport.release()
        if self.optimizer is None:
            return
        t0 = time.perf_counter()
        if clip_coef < 1.0:
            par.clip_grads_(self.module, clip_coef)
        par.set_lr(self.optimizer, lr)  # lr x each param group's lr_scale
        self.optimizer.step()
        accounting.sample(self._acct)
        self.optimizer.zero_grad(set_to_none=True)
        self._timers["step_s"] += time.perf_counter() - t0

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def zero_grads(self) -> None:
        """Drop this step's gradients and in-flight activations (a step refused before the update)."""
        self._inflight.clear()
        if self.transport is not None:
            self.transport.release()
        if self.bridge is not None:
            self.bridge.abandon()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)

    # ---- observation -----------------------------------------------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def take_stats(self) -> dict[str, Any]:
        """This rank's timers and peak memory since the last call; resets both."""
        stats = dict(self._timers) | {
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "optim_state_bytes": _optim_state_bytes(self.optimizer),
            "events": list(self._events),
        }
        self._events.clear()
        accounting.flush(self._acct, module_name=self.module_name, rank=self.rank)
        self._timers = dict.fromkeys(self._timers, 0.0)
        reset_peak_memory(self.device)
        return stats

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def full_grads(self) -> dict[str, torch.Tensor]:
        """``{fqn: full fp32 CPU grad}`` (collective; verify/parity only, tiny models)."""
        return par.full_grad_dict(self.module)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{fqn: full fp32 CPU parameter}`` (collective; verify/parity only, tiny models)."""
        return par.full_param_dict(self.module)

    # ---- checkpoints (dhp.checkpoint does the I/O, collectively) ------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def save_checkpoint(self, path: str) -> None:
        from pathlib import Path

        from dhp.checkpoint import capture_rng_state, save_module_state

        save_module_state(
            Path(path), model=self.module, optimizer=self.optimizer, extra={"rng": capture_rng_state()}
        )

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def save_checkpoint_async(self, path: str) -> float:
        """Stage this rank's state to host memory and write it in the background; returns the staging
        seconds (dhp.checkpoint.async_state; the write's status: ``checkpoint_write_status``)."""
        from pathlib import Path

        from dhp.checkpoint import capture_rng_state
        from dhp.checkpoint.async_state import save_module_state_async

        return save_module_state_async(
            Path(path), model=self.module, optimizer=self.optimizer, extra={"rng": capture_rng_state()}
        )

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def checkpoint_write_status(self, wait: bool) -> dict[str, Any] | None:
        """This rank's in-flight checkpoint write (None: none); ``wait`` blocks until it is written."""
        from dhp.checkpoint.async_state import async_save_status

        return async_save_status(wait=wait)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def load_checkpoint(self, path: str) -> bool:
        """Load model+optimizer (resharding if the plan changed); True if this rank's RNG was restored."""
        from pathlib import Path

        from dhp.checkpoint import load_module_state, restore_rng_state

        extra = load_module_state(Path(path), model=self.module, optimizer=self.optimizer)
        if extra is not None and "rng" in extra:
            restore_rng_state(extra["rng"])
            return True
        return False


def _inner_group(mesh: Any, shape: dict[str, int], axes: tuple[str, ...]) -> Any:
    """The process group of the one axis in ``axes`` with degree > 1 (ranks sharing a batch), or None."""
    live = [a for a in axes if shape.get(a, 1) > 1]
    if not live:
        return None
    if len(live) > 1:
        raise RuntimeFailure(
            f"p2p hand-off: axes {live} both > 1 inside one replica (sp and tp exclude each other)"
        )
    return mesh[live[0]].get_group()


def _is_root(group: Any) -> bool:
    """True without a group, or on the group's rank 0 (the one that talks to the bridge)."""
    return group is None or dist.get_rank(group) == 0


def _optim_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of this rank's optimizer state tensors (local shards); 0 without an optimizer."""
    if optimizer is None:
        return 0
    total = 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                total += local.numel() * local.element_size()
    return total


def _shard_to(shard: Any, device: torch.device) -> Any:
    """The shard with its tensors on ``device`` (a no-op on cpu)."""
    if device.type == "cpu":
        return shard
    import dataclasses

    return dataclasses.replace(
        shard,
        **{
            f.name: getattr(shard, f.name).to(device)
            for f in dataclasses.fields(shard)
            if isinstance(getattr(shard, f.name), torch.Tensor)
        },
    )


def _video_kwargs(batch: VLBatch, device: torch.device) -> dict:
    """``second_per_grid_ts`` for the LLM forward when the micro-batch holds videos (else nothing)."""
    seconds = batch.second_per_grid_ts
    return {} if seconds is None else {"second_per_grid_ts": seconds.to(device)}
