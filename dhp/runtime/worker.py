"""ModuleWorker: one rank of one module of the graph (a producer such as the vision encoder, or the
consumer that computes the loss, the LLM) inside its actor group.

Placement and memory per rank: the module's shard after ``dhp.parallel.parallelize`` (TP: 1/tp of
the LLM's matrices; SP: a full encoder copy with 1/sp of the activations), its gradients and
optimizer state (none when ``freeze``), and the activations of at most two micro-batches in
flight (the encoder runs micro-batch i+1 while the LLM works on i). Every public method declares
its dispatch/collect contract; the driver (``dhp.runtime.driver``) is the only caller.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dhp import parallel as par
from dhp.checkpoint import capture_rng_state, load_module_state, restore_rng_state, save_module_state
from dhp.checkpoint.async_state import async_save_status, save_module_state_async
from dhp.data.batch import VLBatch
from dhp.data.remote import resolve_pixels
from dhp.errors import RuntimeFailure
from dhp.metrics import accounting
from dhp.metrics.memory import peak_memory_bytes, reset_peak_memory
from dhp.metrics.record import module_kernels
from dhp.models import get_family
from dhp.models.dtypes import torch_dtype
from dhp.models.family import StepStatistics
from dhp.models.loading import LoadReport, load_module_weights
from dhp.ops.context import padded_length, rank_index, row_parts
from dhp.ops.linear_attn import require_kernel
from dhp.parallel.lora import apply_lora, init_lora_params
from dhp.runtime.base_worker import DistWorker
from dhp.runtime.device_io import batch_kwargs as _batch_kwargs
from dhp.runtime.device_io import hand_off_tag as _tag
from dhp.runtime.device_io import shard_to as _shard_to
from dhp.runtime.dispatch import Collect, Dispatch, register
from dhp.runtime.eval_worker import EvalMethods
from dhp.runtime.graph import Link
from dhp.runtime.handoff import ProducerWork
from dhp.runtime.spec import WorkerSpec
from dhp.runtime.transport import make_transport

#: seed offset per module so vision and llm draw different random inits from one train.seed
_SEED_STRIDE = 1_000_003


class ModuleWorker(EvalMethods, DistWorker):
    """Build, run and update one module's shard on this rank (see module docstring); evaluate it
    forward only (:class:`~dhp.runtime.eval_worker.EvalMethods`)."""

    def __init__(self, *, module_name: str, rank: int, world_size: int, spec: WorkerSpec) -> None:
        super().__init__(module_name=module_name, rank=rank, world_size=world_size)
        self.spec = spec
        self.model_cfg, self.module_cfg, self.train_cfg = spec.model, spec.module, spec.train
        self.layout = spec.layout  # every degree of this group: the plan's, the one source on the rank
        self.device_type = spec.device
        self.channel = make_transport(
            spec.handoff, bridge_layout=spec.bridge_layout, module=module_name, rank=rank
        )
        self.links_out = tuple(link for link in spec.links if link.producer == module_name)
        self.links_in = tuple(link for link in spec.links if link.consumer == module_name)
        self.frozen = spec.module.freeze
        # the plan's resolved loss chunk (the config's value, or the planner's choice when it is 0)
        self.loss_chunk_tokens = spec.loss_chunk_tokens or spec.module.loss_chunk_tokens
        self._inflight: dict[int, tuple[dict[str, torch.Tensor], ProducerWork]] = {}
        self._step_sums: torch.Tensor | None = None  # this step's batch statistics (statistics_pass), float64
        # handoff_bytes: hand-off bytes this rank copied out of the channel (consumer ranks)
        self._timers = {"fwd_s": 0.0, "bwd_s": 0.0, "step_s": 0.0, "wait_s": 0.0, "handoff_bytes": 0.0}
        self._events: list[tuple[str, int, float, float]] = []  # (method, micro-batch, start, end) wall clock
        self._acct = accounting.from_env(lambda: self.module, lambda: self.optimizer)  # opt-in

    # ---- build -----------------------------------------------------------------------------
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
        self.load_report: LoadReport | None = None
        if self.model_cfg.path is None:
            hf_config = self.hf_config = family.hf_config(self.model_cfg)
            torch.manual_seed(
                self.train_cfg.seed + _SEED_STRIDE * family.module_names.index(self.module_name)
            )
            module = family.build_module(self.module_name, hf_config, device=self.device, dtype=dtype)
            self.module: nn.Module = self._parallelize(module)
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

    # ---- producer ----------------------------------------------------------------------------
    @register(dispatch=Dispatch.PER_RANK, collect=Collect.ALL)
    def produce(self, work: ProducerWork, micro_batch: int, send: bool, *, backward: bool = True) -> Any:
        """Run this rank's input shard through the module; return one payload per consumer replica.

        The module returns ``{kwarg: (rows, width)}`` for its edges; the link's payload to a replica is
        its routed rows of all edges, concatenated (``Link.pack``), or None when no row goes there, or
        when ``send`` is False (TP ranks > 0 of a unit hold the same rows as its rank 0). Activations
        stay here until ``backprop``. ``backward=False`` (the step-statistics pass): no gradient, nothing
        kept, the payloads tagged apart from the micro-batch's own (:func:`_tag`).
        """
        t0, wall = time.perf_counter(), time.time()
        self.faults.at("produce")
        (link,) = self.links_out  # one consumer per producer (the graph's loss module)
        payloads: list[Any] = [None] * work.num_endpoints
        if work.shard is not None:
            with torch.set_grad_enabled(backward and not self.frozen):
                shard = _shard_to(
                    resolve_pixels(work.shard), self.device
                )  # data.engine=ray: rows from the store
                with accounting.saving(self._acct if backward else None):
                    outputs = self.module(**shard.forward_kwargs())
            if backward and not self.frozen:
                self._inflight[micro_batch] = (outputs, work)
            # the rows travel in the compute dtype (the planner's hand-off bytes)
            rows_all = link.pack({k: t.detach().to(self.precision.compute_dtype) for k, t in outputs.items()})
            for route in work.routes if send else ():
                rows = rows_all[route.src.to(self.device)]
                payload = self.channel.pack(
                    rows, to=(link.consumer, route.endpoint), tag=_tag(micro_batch, backward), direction="fwd"
                )
                payloads[route.endpoint] = (payload, route.dst.numpy())
        self._timers["fwd_s"] += time.perf_counter() - t0
        self._events.append(("produce" if backward else "produce_statistics", micro_batch, wall, time.time()))
        return payloads[0] if len(payloads) == 1 else tuple(payloads)

    @register(dispatch=Dispatch.PER_RANK, collect=Collect.NONE)
    def backprop(self, micro_batch: int, grad_refs: list[Any]) -> None:
        """Backpropagate the consumer's gradient rows for this rank's outputs (one ref per consumer
        replica it fed; with a leader-only channel the unit leader receives and broadcasts to its TP peers)."""
        entry = self._inflight.pop(micro_batch, None)
        if entry is None or self.frozen:
            return
        outputs, work = entry
        (link,) = self.links_out
        t0 = time.perf_counter()
        tp_group = par.inner_group(self.mesh, self.layout, ("tp",))
        reads = not self.channel.leader_only or _is_root(tp_group)
        self.faults.at("handback")
        got = ray.get(grad_refs) if reads and grad_refs else []
        self._timers["wait_s"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        rows = next(iter(outputs.values())).shape[0]
        ref = next(iter(outputs.values()))
        grad = torch.zeros(rows, link.grad_width, dtype=ref.dtype, device=ref.device)
        by_endpoint = {r.endpoint: r for r in work.routes}
        for e, payload in enumerate(got):
            if payload is not None:
                g = self.channel.unpack(payload, device=self.device, tag=micro_batch, direction="bwd")
                grad[by_endpoint[e].src.to(self.device)] = g.to(grad.dtype)
        if self.channel.leader_only and tp_group is not None and work.routes:
            dist.broadcast(grad, group=tp_group, group_src=0)
        torch.autograd.backward(*link.backward_pairs(outputs, grad))
        accounting.sample(self._acct)
        self._timers["bwd_s"] += time.perf_counter() - t1

    # ---- consumer ----------------------------------------------------------------------------
    @register(dispatch=Dispatch.SHARD_BY_DP, collect=Collect.DP_LEADERS)
    def consume(
        self,
        batch: VLBatch,
        inbox: dict[str, list[Any]],
        *,
        micro_batch: int,
        num_label_tokens: int,
        grads: bool,
        step_statistics: bool = False,
    ) -> Any:
        """Forward + backward of one micro-batch with ``loss_sum / T``; returns stats and grad payloads.

        ``inbox``: per producer, per endpoint of this replica (one; one per CP rank under context
        parallelism), one payload ref per producer unit (None where it sends nothing): this rank reads
        its own endpoint's. Returns ``(stats, grad_0, ..., grad_{U-1})`` over the units of every incoming
        link in link order when ``grads``, else ``stats``. Only the endpoint's leader (TP rank 0 of its
        unit) sends gradient rows (its TP ranks hold identical ones). ``step_statistics``: the module's
        terms defined on a batch are taken over the step, from the sums of this step's
        :meth:`statistics_pass` (``dhp.models.family.StepStatistics``).
        """
        got, inbox, wait, group, reads = self._receive(inbox)
        wall = time.time()  # the event starts after its inputs arrived
        t1 = time.perf_counter()
        leaves, edge_inputs = self._edge_inputs(
            batch, got, micro_batch, reads=reads, requires_grad=grads, broadcast_in=group
        )
        step = self._step_statistics(num_label_tokens) if step_statistics else None
        self.faults.at("forward")
        with torch.set_grad_enabled(True), accounting.saving(self._acct):
            out = self.module(
                **_batch_kwargs(batch, self.device),
                **({} if step is None else {"step_statistics": step}),
                **edge_inputs,
            )
        t2 = time.perf_counter()
        self._timers["fwd_s"] += t2 - t1
        loss = out.loss_sum / num_label_tokens
        self.faults.at("backward")
        if loss.requires_grad:
            loss.backward()
            accounting.sample(self._acct)
        self._timers["bwd_s"] += time.perf_counter() - t2
        self._events.append(("consume", micro_batch, wall, time.time()))
        stats = {"loss_sum": float(out.loss_sum.detach()), "num_tokens": int(out.num_tokens), "wait_s": wait,
                 "aux_losses": {k: float(v) for k, v in out.aux_losses.items()}}  # fmt: skip
        if not grads:
            return stats
        leader = self.layout.unit_leader(self.layout.unit_of(self.rank)) == self.rank
        payloads: list[Any] = []
        for link in self.links_in:  # per unit of the producer: its rows' gradients, from the leader only
            per_unit: list[Any] = [None] * len(inbox.get(link.producer, []))
            leaf = leaves.get(link.producer)
            for u, value in enumerate(got.get(link.producer, [])):
                if leader and leaf is not None and value is not None:
                    rows = link.grad_of(leaf.grad)[torch.from_numpy(value[1]).to(self.device)]
                    per_unit[u] = self.channel.pack(
                        rows, to=(link.producer, u), tag=micro_batch, direction="bwd"
                    )
            payloads += per_unit
        return (stats, *payloads)

    # ---- the step's statistics (terms defined on the batch) -----------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def batch_terms(self) -> tuple[str, ...]:
        """The module's loss terms defined on a batch (``dhp.models.family.StepStatistics``); () for a
        producer, or a loss without one (the driver runs :meth:`statistics_pass` only for these)."""
        return tuple(getattr(self.module, "batch_terms", ()))  # a loss module without the attribute has none

    @register(dispatch=Dispatch.SHARD_BY_DP, collect=Collect.NONE)
    def statistics_pass(self, batch: VLBatch, inbox: dict[str, list[Any]], *, micro_batch: int) -> None:
        """The step-statistics pass of micro-batch ``micro_batch`` (every micro-batch of the step, before
        any :meth:`consume` of it): the module's forward WITHOUT gradient on the producers' rows of
        their ``produce(backward=False)``, returning its batch statistics over the module's token ranks;
        added to this rank's step sums (reset at micro-batch 0). Nothing is kept for backward; the
        expert-load counters skip this forward (the real one counts). Cost: one forward of the module
        per micro-batch (no LM head or loss); memory: that forward's transients only.
        """
        got, _, _, group, reads = self._receive(inbox)
        wall, t1 = time.time(), time.perf_counter()
        _, edge_inputs = self._edge_inputs(
            batch, got, _tag(micro_batch, False), reads=reads, requires_grad=False, broadcast_in=group
        )
        self.faults.at("statistics")
        with torch.no_grad(), par.expert_load_paused(self.expert_load):
            values = self.module(**_batch_kwargs(batch, self.device), batch_statistics=True, **edge_inputs)
        values = values.double().cpu()
        self._step_sums = values if micro_batch == 0 or self._step_sums is None else self._step_sums + values
        self._timers["fwd_s"] += time.perf_counter() - t1
        self._events.append(("statistics", micro_batch, wall, time.time()))

    def _step_statistics(self, num_label_tokens: int) -> StepStatistics:
        """This step's :class:`~dhp.models.family.StepStatistics` (the sums of its statistics pass)."""
        if self._step_sums is None:
            raise RuntimeFailure(
                f"module {self.module_name!r} rank {self.rank}: asked for the step's statistics before any "
                "statistics_pass of the step (a driver bug)"
            )
        return StepStatistics(values=tuple(self._step_sums.tolist()), num_label_tokens=num_label_tokens)

    def _receive(self, inbox: dict[str, list[Any]]) -> tuple[dict[str, list[Any]], dict, float, Any, bool]:
        """This rank's endpoint's payloads of ``inbox`` (waits for them): ``(got, inbox of this endpoint,
        seconds waited, the endpoint's other ranks' group, whether this rank reads the channel)``."""
        t0 = time.perf_counter()
        part = self.layout.coords(self.rank)["cp"]
        inbox = {p: parts[part] for p, parts in inbox.items()}
        group = par.inner_group(self.mesh, self.layout, ("sp", "tp"))  # the endpoint's other ranks
        reads = not self.channel.leader_only or _is_root(group)
        # a leader-only channel: the other ranks of the replica read nothing (the leader broadcasts)
        flat = [ref for refs in inbox.values() for ref in refs if ref is not None] if reads else []
        self.faults.at("handoff")
        values = iter(ray.get(flat))
        got = {
            p: [None if ref is None or not reads else next(values) for ref in refs]
            for p, refs in inbox.items()
        }
        wait = time.perf_counter() - t0
        self._timers["wait_s"] += wait
        return got, inbox, wait, group, reads

    def _edge_inputs(
        self, batch: VLBatch, got: dict, tag: int, *, reads: bool, requires_grad: bool, broadcast_in: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
        """(one leaf per incoming link, the module's edge keyword arguments: views of the leaves)."""
        leaves = {link.producer: self._assemble(batch, link, got[link.producer] if reads else None, tag,
                                                requires_grad=requires_grad, broadcast_in=broadcast_in)
                  for link in self.links_in if link.producer in got}  # fmt: skip
        edge_inputs: dict[str, torch.Tensor | None] = {}
        for link in self.links_in:
            leaf = leaves.get(link.producer)
            edge_inputs.update(
                link.split(leaf) if leaf is not None else dict.fromkeys(e.kwarg for e in link.edges)
            )
        return leaves, edge_inputs

    def _assemble(
        self,
        batch: VLBatch,
        link: Link,
        arrivals: list[Any] | None,
        micro_batch: int,
        *,
        requires_grad: bool,
        broadcast_in: Any = None,
    ) -> torch.Tensor | None:
        """The link's ``(rows of the micro-batch, link.width)`` leaf that collects the gradient.

        ``arrivals``: per producer unit ``(payload, dst rows)`` or None; each payload's rows land at its
        dst rows. ``arrivals`` None: this rank receives the whole tensor by a broadcast from rank 0 of
        ``broadcast_in`` (a leader-only channel: only the replica leader talks to it).
        """
        if batch.image_grid_thw is None:
            return None
        n = self._endpoint_rows(batch)
        # the leaf is in this module's compute dtype: its gradient rows go back in it too
        rows_all = torch.zeros(n, link.width, dtype=self.precision.compute_dtype, device=self.device)
        if arrivals is not None:
            filled = 0
            own = self._own_rows(batch) if not self.channel.leader_only else None
            for value in arrivals:
                if value is None:
                    continue
                payload, dst = value
                rows = self.channel.unpack(payload, device=self.device, tag=micro_batch, direction="fwd")
                filled += len(dst)
                dst = torch.from_numpy(dst)
                if own is not None:  # sequence parallel: copy only the rows of this rank's shard
                    keep = own[dst]
                    dst, rows = dst[keep], rows[keep.to(rows.device)]
                rows_all[dst.to(self.device)] = rows.to(rows_all.dtype)
                self._timers["handoff_bytes"] += rows.numel() * rows.element_size()
            if filled != n:
                raise RuntimeFailure(
                    f"module {self.module_name!r} rank {self.rank}: hand-off delivered {filled} rows from "
                    f"{link.producer!r}, the micro-batch {batch.sample_ids} has {n} (a routing bug)"
                )
        if self.channel.leader_only and broadcast_in is not None:
            dist.broadcast(rows_all, group=broadcast_in, group_src=0)
        return rows_all.requires_grad_(requires_grad)

    def _endpoint_rows(self, batch: VLBatch) -> int:
        """Hand-off rows this rank's endpoint takes of ``batch``: every image-token row, or under context
        parallelism those of this CP rank's tokens (``dhp.ops.context.row_parts``)."""
        lay = self.layout
        if lay.cp == 1:
            return sum(self.family.tokens_per_image(self.hf_config, batch.image_grid_thw))
        part, _ = row_parts(batch.mm_token_type_ids != 0, cp=lay.cp, multiple=lay.token_multiple)
        return int((part == lay.coords(self.rank)["cp"]).sum())

    def _own_rows(self, batch: VLBatch) -> torch.Tensor | None:
        """Sequence parallelism inside TP: a bool mask over the endpoint's image-embedding rows, True
        for the rows whose tokens fall into this TP rank's sequence shard (the only rows the LLM reads
        here; the rest are cut away before layer 0). None without SP: every row is needed. Under context
        parallelism the shard is of this CP rank's tokens."""
        lay = self.layout
        if lay.seq_split == 1:
            return None
        ids = batch.input_ids
        if lay.cp > 1:  # the CP rank's tokens of the padded micro-batch, in their local order
            seq = padded_length(ids.shape[1], lay.token_multiple)
            ids = F.pad(ids, (0, seq - ids.shape[1]), value=-1)[
                :, rank_index(seq, lay.cp, lay.coords(self.rank)["cp"])
            ]
        return par.sequence_shard_rows(
            ids,
            (self.model_cfg.tokens.image_token_id, self.model_cfg.tokens.video_token_id),
            tp=lay.tp,
            rank=self.mesh["tp"].get_local_rank(),
        )

    # ---- optimizer -------------------------------------------------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def finalize_grads(self) -> float:
        """Reduce grads over SP/DP (sums) and return the module's squared grad norm (same on all ranks)."""
        self.channel.drain()  # every backward ran: each send has been received
        norm_sq = 0.0
        if not self.frozen:
            t0 = time.perf_counter()
            par.finalize_grads(self.module, self.mesh, self.layout)
            norm_sq = float(par.grad_norm_sq(self.module, self.mesh))
            self._timers["step_s"] += time.perf_counter() - t0
        self.faults.at("grad_sync")  # after the sync's collectives: a hang here is this rank's alone
        return norm_sq

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def optimizer_step(self, *, lr: float, clip_coef: float) -> None:
        """Scale grads by ``clip_coef`` (< 1 when clipping), AdamW step at ``lr``, zero the grads."""
        self.faults.at("optimizer")
        self.channel.release()
        if self.optimizer is not None:
            t0 = time.perf_counter()
            if clip_coef < 1.0:
                par.clip_grads_(self.module, clip_coef)
            par.set_lr(self.optimizer, lr)  # lr x each param group's lr_scale
            self.optimizer.step()
            accounting.sample(self._acct)
            self.optimizer.zero_grad(set_to_none=True)
            self._timers["step_s"] += time.perf_counter() - t0
        self.faults.step_done()

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.NONE)
    def zero_grads(self) -> None:
        """Drop this step's gradients and in-flight activations (a step refused before the update)."""
        self._inflight.clear()
        self.channel.abandon()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)

    # ---- observation -----------------------------------------------------------------------
    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def take_stats(self) -> dict[str, Any]:
        """This rank's timers and peak memory since the last call; resets both. ``expert_load``: the
        step's tokens per expert over the group's MoE layers (``dhp.parallel.expert_load``; one
        all-reduce over the group), None for a module without MoE blocks."""
        stats = dict(self._timers) | {
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "optim_state_bytes": _optim_state_bytes(self.optimizer),
            "expert_load": _take_expert_load(self.expert_load, self.device),  # collective
            "events": list(self._events),
            "kernels": self.kernels,  # what this process runs (e.g. a linear-attention torch fallback)
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
        """Write this rank's model + optimizer state (and RNG) into ``path`` (DCP, collectively)."""
        self.faults.at("save")
        save_module_state(
            Path(path), model=self.module, optimizer=self.optimizer, extra={"rng": capture_rng_state()}
        )

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def save_checkpoint_async(self, path: str) -> float:
        """Stage this rank's state to host memory and write it in the background; returns the staging
        seconds (dhp.checkpoint.async_state; the write's status: ``checkpoint_write_status``)."""
        staging_s = save_module_state_async(
            Path(path), model=self.module, optimizer=self.optimizer, extra={"rng": capture_rng_state()}
        )
        self.faults.at("save_async")  # the write runs in the background now
        return staging_s

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.ALL)
    def checkpoint_write_status(self, wait: bool) -> dict[str, Any] | None:
        """This rank's in-flight checkpoint write (None: none); ``wait`` blocks until it is written."""

        return async_save_status(wait=wait)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect=Collect.RANK0)
    def load_checkpoint(self, path: str) -> bool:
        """Load model+optimizer (resharding if the plan changed); True if this rank's RNG was restored."""

        extra = load_module_state(Path(path), model=self.module, optimizer=self.optimizer)
        if extra is not None and "rng" in extra:
            restore_rng_state(extra["rng"])
            return True
        return False


def _is_root(group: Any) -> bool:
    """True without a group, or on the group's rank 0 (the one that talks to the bridge)."""
    return group is None or dist.get_rank(group) == 0


def _track_expert_load(module: nn.Module, *, tp: int) -> par.ExpertLoad | None:
    """Per-layer tokens-per-expert counters on the family's MoE blocks (None: the module has none)."""
    plan = par.module_plan(module)
    return par.track_expert_load(module, plan.moe_blocks, duplicates=tp) if plan.moe_blocks else None


def _take_expert_load(load: par.ExpertLoad | None, device: torch.device) -> dict[str, Any] | None:
    """The step's expert-load summary for ``metrics.jsonl`` (collective over the group), or None."""
    summary = None if load is None else load.take(device=device)
    return None if summary is None else summary.as_record()


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
