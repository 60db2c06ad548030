"""Shrink any recipe to a tiny CPU run that keeps each module's parallel strategy.

``smoke_config`` is pure: it copies the composed config and rewrites it so that it validates and
fits the 4 gloo ranks of ``conf/cluster/local_cpu.yaml``:

- model: the tiny architecture (``conf/model/tiny.yaml``), the family kept, no weights path;
- cluster: local_cpu;
- every parallel degree > 1 becomes 2, so the axes in use stay in use (SP stays SP, TP stays TP,
  FSDP stays FSDP); ``gpus`` is recomputed. When the groups would still need more than the local
  ranks, ``dp`` is dropped first (it is the axis least specific to a strategy), then ``fsdp``;
  collocated groups left with different rank counts get ``dp`` up to the largest count;
- pipeline stages: pp > 1 becomes 2 (the tiny decoders have at least 2 layers); a schedule with
  several stages per rank whose ``pp x pp_virtual`` stages outnumber the tiny model's layers falls
  back to 1f1b with one stage per rank (the pipeline stays, its interleaving cannot);
- train: 2 steps (``train.epochs`` off), no warmup, micro batch 1 (or the encoder/LLM replica ratio),
  global batch = micro * the consumer's replicas (times pp: a pipeline schedule runs at least one
  micro-batch per stage), no checkpoints but the last; an evaluation the recipe asks
  for (``data.eval``) runs after each of the 2 steps, on the eval batches of one step's shape;
- data: small synthetic samples; sequence lengths sized to them.

``keep_model_path`` (a ``model.path=DIR`` given on the command line: a tiny checkpoint in the real
layout of the recipe's family, ``scripts/make_tiny_checkpoint.py``): the run reads that checkpoint
(tokenizer, chat template, image processor, weights) and keeps the recipe's real data
(``data.path``), its images shrunk to at most ``SMOKE_MAX_PIXELS`` and its conversations given
``SMOKE_REAL_LLM_SEQ`` tokens. So a fine-tune of a real size trains end to end on its tiny
counterpart: ``dhp train conf=qwen_vl_7b train=sft data=sft smoke=true model.path=TINY data.path=FILE``.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

from dhp.config.placement import parse_placement
from dhp.layout import MESH_AXES, module_layout, write_layout

SMOKE_STEPS = 2
SMOKE_PATCHES = 64  # one 112x112 image: 8x8 patches of 14 px, 16 LLM tokens after the 2x2 merge
SMOKE_TEXT_TOKENS = 32
SMOKE_VISION_SEQ = 256
SMOKE_AUDIO_FRAMES = 64  # one synthetic audio: 0.64 s of 10 ms mel frames, 16 tokens after a 4x cut
SMOKE_LLM_SEQ = 128
SMOKE_MAX_PIXELS = 112 * 112  # real photos: at most 64 patches of 14 px (49 of 16 px) per image
SMOKE_REAL_LLM_SEQ = 512  # a real conversation of the tiny tokenizer, an image's tokens included
SMOKE_EVAL_SAMPLES = 4  # an evaluation reads at most this many eval samples


def _set(mod: DictConfig, **degrees: int | str | tuple[int, ...]) -> None:
    """Rewrite some of ``mod``'s degrees and recount its GPUs."""
    lay = module_layout(mod).replace(**degrees)
    write_layout(mod, lay)
    mod.gpus = lay.world_size


def _shrink_degrees(mod: DictConfig) -> None:
    lay = module_layout(mod)
    _set(mod, **{axis: 2 for axis in (*MESH_AXES, "ep") if getattr(lay, axis) > 1})


def _fit_stages(mod: DictConfig, layers: int) -> None:
    """Every stage needs a decoder layer: too many stages per rank for the tiny model's ``layers``
    drop to 1f1b with one stage per rank; a user's cut of the full model becomes the balanced one."""
    lay = module_layout(mod)
    if lay.pp_cut:
        _set(mod, pp_cut=())
    if lay.pp > 1 and lay.num_stages > layers:
        _set(mod, pp_virtual=1, pp_schedule="1f1b")


def _fold_ep(mod: DictConfig) -> None:
    """Expert parallelism folds over the dp x fsdp x sp ranks left after shrinking: ep keeps the
    largest degree that still divides them (the strategy stays where the ranks allow it)."""
    lay = module_layout(mod)
    _set(mod, ep=math.gcd(lay.ep, lay.token_ranks))


def _sets(cfg: DictConfig) -> tuple[tuple[str, ...], ...]:
    """The placement's GPU-sharing sets (``dhp.config.placement``); one set per module when invalid
    (validation names that)."""
    names = [str(n) for n in cfg.modules]
    sets, problem = parse_placement(str(cfg.placement), names)
    return tuple((n,) for n in names) if problem is not None else tuple(sets)


def _needed(cfg: DictConfig) -> int:
    """GPUs of the run: per sharing set its widest module, summed over the sets."""
    if not cfg.modules:
        return 0
    return sum(max(cfg.modules[n].gpus for n in group) for group in _sets(cfg))


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
    for group in _sets(cfg) if cfg.modules else ():
        mods = [cfg.modules[n] for n in group]
        most = max(m.gpus for m in mods)
        for mod in mods:
            if mod.gpus < most and most % mod.gpus == 0:
                _set(mod, dp=module_layout(mod).dp * (most // mod.gpus))


def _replicas(cfg: DictConfig, name: str | None) -> int:
    if name not in cfg.modules:
        return 1
    return module_layout(cfg.modules[name]).num_replicas


def smoke_config(
    cfg: DictConfig,
    *,
    tiny_model: DictConfig,
    local_cluster: DictConfig,
    consumer: str | None,
    keep_model_path: bool = False,
) -> DictConfig:
    """Return a shrunken copy of ``cfg`` (the input is not modified); see the module docstring.

    ``consumer``: the module with the loss (the family's last declared module; None for a family
    validation does not know), whose rows the micro-batches are; every other module is a producer."""
    out = cfg.copy()
    family, path = out.model.family, out.model.path
    real = keep_model_path and path is not None and out.data.kind == "llava"
    out.model = OmegaConf.merge(out.model, tiny_model)
    out.model.family = family
    out.model.path = path if real else None
    out.model.attn_implementation = "sdpa"
    out.cluster = OmegaConf.merge(out.cluster, local_cluster)
    for mod in out.modules.values():
        _shrink_degrees(mod)
        mod.mixed_precision = "fp32"
    _fit(out, out.cluster.nodes * out.cluster.gpus_per_node)
    _share_gpus(out)
    for mod in out.modules.values():
        _fold_ep(mod)
        _fit_stages(mod, int(out.model.llm.num_layers))
    producers = [str(n) for n in out.modules if n != consumer]  # every encoder (vision, audio, ...)
    for name in producers:  # patches, or mel frames, of one micro-batch
        out.modules[name].seq_len = SMOKE_VISION_SEQ
    if consumer in out.modules:
        out.modules[consumer].seq_len = SMOKE_REAL_LLM_SEQ if real else SMOKE_LLM_SEQ
    rl = _replicas(out, consumer)
    rv = math.lcm(*(_replicas(out, n) for n in producers), 1)
    # a consumer micro-batch feeds every encoder replica
    pp = module_layout(out.modules[consumer]).pp if consumer in out.modules else 1
    _shrink_train(out.train, micro=max(1, rv // rl), consumer_replicas=rl * pp)
    if real:
        _shrink_real_data(out.data)
    else:
        _synthetic_data(out.data)
    _shrink_eval(out)
    return out


def _shrink_train(train: DictConfig, *, micro: int, consumer_replicas: int) -> None:
    train.steps = SMOKE_STEPS
    train.epochs = 0
    train.warmup_steps = 0
    train.warmup_ratio = 0.0
    train.micro_batch_size = micro
    train.global_batch_size = micro * consumer_replicas
    train.checkpoint_every = 0
    train.resume = None


def _shrink_real_data(data: DictConfig) -> None:
    """The recipe's real data with small images, read on the driver."""
    data.max_pixels = SMOKE_MAX_PIXELS
    data.min_pixels = min(data.min_pixels, SMOKE_MAX_PIXELS)
    data.num_workers = 0
    data.engine = "local"


def _shrink_eval(cfg: DictConfig) -> None:
    """An evaluation the recipe asks for runs after each smoke step, on batches of a step's shape;
    an eval file needs real data (a synthetic run holds out its own samples instead)."""
    ev = cfg.data.eval
    if not (ev.path or ev.split > 0):
        return
    if ev.path and cfg.data.kind == "synthetic":
        ev.path, ev.split = "", 0.25
    ev.batch_size = 0
    ev.max_samples = min(ev.max_samples, SMOKE_EVAL_SAMPLES) if ev.max_samples else SMOKE_EVAL_SAMPLES
    cfg.train.eval_every = 1


def _synthetic_data(data: DictConfig) -> None:
    data.kind = "synthetic"
    data.datasets = []
    data.synthetic.num_samples = 8
    data.synthetic.patches = SMOKE_PATCHES
    data.synthetic.images_per_sample = 1
    data.synthetic.text_tokens = SMOKE_TEXT_TOKENS
    data.synthetic.audio_frames = SMOKE_AUDIO_FRAMES  # used only by a model with an audio encoder
    data.num_workers = 0
    data.engine = "local"  # one CPU box: no data actors to start
