"""Build one ``metrics.jsonl`` record from a driver StepResult (fixed names, honest throughput)."""

from __future__ import annotations

from typing import Any

from dhp.config.schema import ClusterConfig, ModelConfig, ModuleConfig
from dhp.metrics.flops import model_flops_per_step
from dhp.models.registry import get_arch
from dhp.ops.linear_attn import linear_attention_kernel


def step_tokens(data: Any, *, merge: int) -> tuple[list[int], list[int]]:
    """(patches per image, real tokens per sample) of a StepData, over all replicas and micro-batches."""
    patches, seqs = [], []
    for micro in data.micro_batches:
        for b in micro:
            if b.image_grid_thw is not None:
                patches += [int(g.prod()) for g in b.image_grid_thw]
            seqs += [int(n) for n in b.attention_mask.sum(dim=1)]
    return patches, seqs


def group_lrs(modules: dict[str, ModuleConfig], *, lr: float, base_lr: float) -> dict[str, float]:
    """The LR each optimizer param group runs at this step, ``{"<module>/<group>": lr}``.

    ``lr`` is the schedule's LR for the step; ``base_lr`` is ``train.lr``. Group ``default`` holds the
    parameters no ``param_groups`` glob matches; each glob's group runs at ``lr * its_lr / base_lr``,
    as ``dhp.parallel.param_groups.set_lr`` applies it (schedule scales every group alike). Frozen
    modules have no optimizer and no entry.
    """
    out: dict[str, float] = {}
    for name, mod in modules.items():
        if mod.freeze:
            continue
        out[f"{name}/default"] = lr
        for g in mod.param_groups:
            scale = (g.lr / base_lr if base_lr > 0 else 1.0) if g.lr is not None else 1.0
            out[f"{name}/{g.match}"] = lr * scale
    return out


def module_kernels(model: ModelConfig, *, module: str, device_type: str) -> dict[str, str]:
    """The kernels this process runs for ``module``'s layers, by kind: ``{"linear_attention": name}`` when
    the family declares linear-attention blocks in it (``dhp.ops.linear_attn``), else ``{}``."""
    arch = get_arch(model.family).architecture(model).modules[module]
    return {"linear_attention": linear_attention_kernel(device_type)} if arch.count("linear") else {}


def build_record(
    *,
    step: int,
    result: Any,
    data: Any,
    lr: float,
    base_lr: float,
    model: ModelConfig,
    modules: dict[str, ModuleConfig],
    cluster: ClusterConfig,
    world_devices: int,
) -> dict[str, Any]:
    """The fixed-name record (see ``dhp.metrics.METRIC_KEYS``); ``lr_groups`` per :func:`group_lrs`.

    tokens/s: vision = encoder patches, text = LLM tokens (attention mask), per step wall time.
    MFU = (encoder + LLM model FLOPs) / step_s / (cluster.peak_bf16_tflops * devices), PaLM formula.
    Per-module seconds are the max over that module's ranks; ``wait_s`` is the LLM waiting on the
    hand-off; ``peak_mem_bytes`` is per "<module>/<rank>" (cuda: allocated peak; cpu: RSS high-water mark, reset per window on Linux);
    ``bad_samples`` counts the samples skipped so far by reason (``data.on_bad_sample=skip``);
    ``expert_load`` per module with MoE layers: the worst layer's max and mean tokens per expert,
    their ratio and the layer (``dhp.parallel.expert_load.LoadSummary.as_record``), {} without MoE.
    ``kernels`` names the kernels each module's ranks ran, ``{"<module>/<kind>": name}`` (e.g.
    ``llm/linear_attention: torch-fallback``; ranks that differ are listed comma-separated), so a slow
    fallback on a GPU shows in every record.
    """
    patches, seqs = step_tokens(data, merge=model.vision.spatial_merge_size)
    frozen = {name: bool(mod.freeze) for name, mod in modules.items()}
    flops = model_flops_per_step(model, image_patches=patches, seq_lens=seqs, frozen=frozen)
    dt = max(result.step_s, 1e-9)
    rec: dict[str, Any] = {
        "step": step,
        "loss": result.loss,
        "lr": lr,
        "lr_groups": group_lrs(modules, lr=lr, base_lr=base_lr),
        "grad_norm": result.grad_norm,
        "tokens_per_s_vision": sum(patches) / dt,
        "tokens_per_s_text": sum(seqs) / dt,
        "step_s": result.step_s,
        "wait_s": result.consumer_wait_s,
        "handoff_s": max((s["wait_s"] for ranks in result.stats.values() for s in ranks), default=0.0),
        "peak_mem_bytes": {
            f"{m}/{r}": s["peak_mem_bytes"] for m, ranks in result.stats.items() for r, s in enumerate(ranks)
        },
        "mfu": flops / dt / (cluster.peak_bf16_tflops * 1e12 * world_devices),
        "bad_samples": dict(data.bad_samples),
        "data": dict(getattr(data, "metrics", {})),  # the loader's wait_s, samples_per_s, workers
        "aux_losses": dict(result.aux_losses),  # e.g. router_aux_loss, unweighted (the loss holds coef x it)
        # per module with MoE layers: the step's tokens per expert (worst layer), same on every rank
        "expert_load": {
            m: ranks[0]["expert_load"]
            for m, ranks in result.stats.items()
            if ranks[0]["expert_load"] is not None
        },
        "kernels": {
            f"{m}/{kind}": ",".join(sorted({s["kernels"][kind] for s in ranks}))
            for m, ranks in result.stats.items()
            for kind in ranks[0]["kernels"]
        },
    }
    for m, ranks in result.stats.items():
        for part in ("fwd", "bwd", "step"):
            rec[f"{m}_{part}_s"] = max(s[f"{part}_s"] for s in ranks)
    return rec
