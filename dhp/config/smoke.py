"""Shrink any recipe to a tiny CPU run that keeps each module's parallel strategy.

``smoke_config`` is pure: it copies the composed config and rewrites it so that it validates and
fits the 4 gloo ranks of ``conf/cluster/local_cpu.yaml``:

- model: the tiny architecture (``conf/model/tiny.yaml``), the family kept, no weights path;
- cluster: local_cpu;
- every parallel degree > 1 becomes 2, so the axes in use stay in use (SP stays SP, TP stays TP,
  FSDP stays FSDP); ``gpus`` is recomputed. When the groups would still need more than the local
  ranks, ``dp`` is dropped first (it is the axis least specific to a strategy), then ``fsdp``;
  collocated groups left with different rank counts get ``dp`` up to the largest count;
- train: 2 steps, no warmup, micro batch 1 (or the encoder/LLM replica ratio), global batch =
  micro * LLM replicas, no checkpoints;
- data: small synthetic samples; sequence lengths sized to them.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

from dhp.layout import MESH_AXES, module_layout, write_layout

SMOKE_STEPS = 2
SMOKE_PATCHES = 64  # one 112x112 image: 8x8 patches of 14 px, 16 LLM tokens after the 2x2 merge
SMOKE_TEXT_TOKENS = 32
SMOKE_VISION_SEQ = 256
SMOKE_LLM_SEQ = 128


def _set(mod: DictConfig, **degrees: int) -> None:
    """Rewrite some of ``mod``'s degrees and recount its GPUs."""
    lay = module_layout(mod).replace(**degrees)
    write_layout(mod, lay)
    mod.gpus = lay.world_size


def _shrink_degrees(mod: DictConfig) -> None:
    lay = module_layout(mod)
    _set(mod, **{axis: 2 for axis in (*MESH_AXES, "ep") if getattr(lay, axis) > 1})


def _fold_ep(mod: DictConfig) -> None:
    """Expert parallelism folds over the dp x fsdp x sp ranks left after shrinking: ep keeps the
    largest degree that still divides them (the strategy stays where the ranks allow it)."""
    lay = module_layout(mod)
    _set(mod, ep=math.gcd(lay.ep, lay.token_ranks))


def _needed(cfg: DictConfig) -> int:
    counts = [m.gpus for m in cfg.modules.values()]
    if not counts:
        return 0
    return sum(counts) if cfg.placement == "disaggregated" else max(counts)


def _fit(cfg: DictConfig, ranks: int) -> None:
    for axis in ("dp", "fsdp"):
        for mod in cfg.modules.values():
            if _needed(cfg) <= ranks:
                return
            if getattr(module_layout(mod), axis) > 1:
                _set(mod, **{axis: 1})


def _share_gpus(cfg: DictConfig) -> None:
    """Collocated groups share one GPU set: a group that shrank to fewer ranks than another (sp8 -> 2
    beside fsdp4 x tp2 -> 4) gets data parallelism up to the others' count, keeping its strategy."""
    if cfg.placement != "collocated" or not cfg.modules:
        return
    most = max(m.gpus for m in cfg.modules.values())
    for mod in cfg.modules.values():
        if mod.gpus < most and most % mod.gpus == 0:
            _set(mod, dp=module_layout(mod).dp * (most // mod.gpus))


def _replicas(cfg: DictConfig, name: str) -> int:
    if name not in cfg.modules:
        return 1
    return module_layout(cfg.modules[name]).num_replicas


def smoke_config(cfg: DictConfig, *, tiny_model: DictConfig, local_cluster: DictConfig) -> DictConfig:
    """Return a shrunken copy of ``cfg`` (the input is not modified); see the module docstring."""
    out = cfg.copy()
    family = out.model.family
    out.model = OmegaConf.merge(out.model, tiny_model)
    out.model.family = family
    out.model.path = None
    out.model.attn_implementation = "sdpa"
    out.cluster = OmegaConf.merge(out.cluster, local_cluster)
    for mod in out.modules.values():
        _shrink_degrees(mod)
        mod.mixed_precision = "fp32"
    _fit(out, out.cluster.nodes * out.cluster.gpus_per_node)
    _share_gpus(out)
    for mod in out.modules.values():
        _fold_ep(mod)
    if "vision" in out.modules:
        out.modules.vision.seq_len = SMOKE_VISION_SEQ
    if "llm" in out.modules:
        out.modules.llm.seq_len = SMOKE_LLM_SEQ
    rl, rv = _replicas(out, "llm"), _replicas(out, "vision")
    train = out.train
    train.steps = SMOKE_STEPS
    train.warmup_steps = 0
    train.micro_batch_size = max(1, rv // rl)  # an LLM micro-batch feeds every encoder replica
    train.global_batch_size = train.micro_batch_size * rl
    train.checkpoint_every = 0
    train.resume = None
    data = out.data
    data.kind = "synthetic"
    data.datasets = []
    data.synthetic.num_samples = 8
    data.synthetic.patches = SMOKE_PATCHES
    data.synthetic.images_per_sample = 1
    data.synthetic.text_tokens = SMOKE_TEXT_TOKENS
    data.num_workers = 0
    data.engine = "local"  # one CPU box: no data actors to start
    return out
