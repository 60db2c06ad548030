"""The workload a plan's numbers are for (``Plan.workload``, ``dhp plan --json``'s ``workload``).

Memory is planned at the ``seq_len`` bounds; the step time on the data's sizes: the synthetic
config's, or the rows start-up sampled (``data.lengths``, ``dhp.data.lengths``). This says both, in
the planner's own terms (``timing_shapes``, ``vision_patches_per_replica``, ``sp_rank_tokens``):

- ``batch``: samples per micro-batch (per LLM data replica) and per step, micro-batches per step,
  the data replicas of each module;
- ``per_sample``: images, videos, video frames and audio clips per sample, and its LLM tokens and
  encoder patches (mean and largest), from the synthetic config or the sampled rows;
- ``modules``: per module its bound (``seq_len``, what memory is planned at) and the micro-batch the
  step time is computed on: a pixel module's patches per replica and per SP rank, a loss module's
  rows and tokens per row (the bounds themselves when the data's sizes are unknown);
- ``tokens_per_step``: the step's LLM tokens (text, image and video positions, no padding, as
  ``metrics.jsonl`` counts ``tokens_per_s_text``) and encoder patches (``tokens_per_s_vision``), and the
  LLM positions computed with the micro-batches' padding (``llm_padded``).

Per-sample sizes of real data whose rows were not measured are ``None``.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig

from dhp.config.validate_data_keys import synthetic_sample_tokens
from dhp.layout import ParallelLayout
from dhp.plan.estimate import data_lengths, producer_patches_per_replica, timing_shapes
from dhp.plan.graph import run_graph
from dhp.plan.memory import ModuleShape, sp_rank_tokens
from dhp.plan.params import architecture, video_frames_per_row
from dhp.plan.schedule import micro_batches_per_step


def _per_sample(config: DictConfig) -> tuple[str, dict]:
    """(where the sizes come from, the per-sample counts)."""
    data = config.data
    if data.kind == "synthetic":
        syn, temporal = data.synthetic, video_frames_per_row(config.model)
        merge = _pixel_merge(config)
        longest = max(syn.text_tokens, syn.text_tokens_max)
        mean_text = (syn.text_tokens + longest) / 2

        def tokens(text: float) -> float:
            return (
                synthetic_sample_tokens(
                    syn, spatial_merge_size=merge, temporal_patch_size=temporal, text_tokens=0
                )
                + text
            )

        patches = syn.patches * (
            syn.images_per_sample + syn.videos_per_sample * (syn.video_frames // temporal)
        )
        return "synthetic", {
            "images": syn.images_per_sample,
            "videos": syn.videos_per_sample,
            "video_frames": syn.videos_per_sample * syn.video_frames,
            "audio": 0,
            "llm_tokens": tokens(mean_text),
            "llm_tokens_max": int(tokens(longest)),
            "vision_patches": float(patches),
            "vision_patches_max": int(patches),
        }
    lengths = data_lengths(config)
    if lengths is None:
        keys = ("images", "videos", "video_frames", "audio", "llm_tokens", "llm_tokens_max")
        return "not measured (sizes at the seq_len bounds)", {
            **dict.fromkeys(keys),
            "vision_patches": None,
            "vision_patches_max": None,
        }
    n = lengths.rows
    return f"{n} rows sampled of {lengths.of_rows}", {
        "images": (lengths.media - lengths.videos) / n,
        "videos": lengths.videos / n,
        "video_frames": lengths.video_frames / n,
        "audio": 0,  # no family has an audio module: audio records are refused
        "llm_tokens": sum(lengths.tokens) / n,
        "llm_tokens_max": max(lengths.tokens),
        "vision_patches": sum(lengths.patches) / n,
        "vision_patches_max": max(lengths.patches),
    }


def _pixel_merge(config: DictConfig) -> int:
    """Patches per side of one merged row of the model's pixel-input module (its declared ``merge``
    is side x side), 1 without one."""
    pixel = [m for m in architecture(config.model).modules.values() if m.input_row]
    return math.isqrt(pixel[0].merge) if pixel else 1


def _module(config: DictConfig, shape: ModuleShape, *, consumer: ParallelLayout) -> dict:
    """One module's bound and the micro-batch the step time is computed on (``shape``: timed)."""
    out: dict = {"seq_len": int(config.modules[shape.name].seq_len), "replicas": shape.layout.num_replicas}
    if shape.pixels:
        patches = producer_patches_per_replica(
            config,
            seq_len=shape.seq_len,
            micro_batch=config.train.micro_batch_size,
            consumer_replicas=consumer.num_replicas,
            producer_replicas=shape.layout.num_replicas,
        )
        out.update(
            sp=shape.layout.sp,
            patches_per_micro_batch=patches,
            patches_per_rank=sp_rank_tokens(shape.arch, patches, shape.layout.sp, shape.image_patches),
        )
    if shape.vocab:
        out.update(
            rows_per_micro_batch=shape.micro_batch,
            tokens_per_row=shape.seq_len,
            tokens_per_micro_batch=shape.micro_batch * shape.seq_len,
        )
    return out


def plan_workload(
    config: DictConfig, shapes: dict[str, ModuleShape], layouts: dict[str, ParallelLayout]
) -> dict:
    """The ``workload`` document of a plan (module docstring): ``shapes`` as memory plans them
    (``compile.module_shapes``), ``layouts`` every module's."""
    loss = run_graph(config).consumer
    source, sample = _per_sample(config)
    measured = sample["llm_tokens"] is not None
    timed = timing_shapes(config, shapes)
    train = config.train
    n_mb = micro_batches_per_step(train, layouts[loss].num_replicas)
    gbs = int(train.global_batch_size)
    modules = {name: _module(config, shape, consumer=layouts[loss]) for name, shape in timed.items()}
    lm = timed[loss]
    return {
        "source": source,
        "batch": {
            "micro_batch_size": int(train.micro_batch_size),
            "global_batch_size": gbs,
            "micro_batches_per_step": n_mb,
        },
        "per_sample": sample,
        "modules": modules,
        "tokens_per_step": {
            "text": gbs * sample["llm_tokens"] if measured else None,
            "vision": gbs * sample["vision_patches"] if measured else None,
            "llm_padded": n_mb * layouts[loss].num_replicas * lm.micro_batch * lm.seq_len,
        },
    }
