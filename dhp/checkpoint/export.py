"""Export a dhp checkpoint (DCP per module group) to a Hugging Face model directory.

Runs in one plain process (no torch.distributed). Tensors are read from the DCP shards in batches of
at most ``max_shard_bytes`` and written as ``model-XXXXX-of-YYYYY.safetensors`` plus an index, so peak
memory is about one shard, not the whole model. Keys follow the family's reference transformers
model (``family.reference_model``'s state-dict keys, e.g. ``model.language_model.*``, ``lm_head.*``),
loadable with that transformers class's ``from_pretrained``.

When ``model.path`` is a full model directory whose tensors include modules outside the family's graph
(an omni model's speech output: ``talker.*``, ``token2wav.*`` / ``code2wav.*``), the export rebuilds that
full directory instead (``dhp.checkpoint.carried``): the trained tensors under the source's own names
(e.g. ``thinker.model.layers.*``) and in its stored dimension order, every other tensor copied from the
source shard by shard with its bytes unchanged, and the source's ``config.json``; the same class that
loaded the source (``Qwen2_5OmniForConditionalGeneration``) loads the export.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dhp.checkpoint.carried import FullSource, batches, full_source, read_carried
from dhp.checkpoint.layout import resolve_checkpoint
from dhp.checkpoint.lora_export import (
    ADAPTER_DIR,
    adapted_layers,
    base_fqn,
    check_mode,
    is_adapter,
    lora_deltas,
    merged,
    write_adapter,
)
from dhp.checkpoint.meta import read_meta
from dhp.checkpoint.module_state import MODEL_KEY, single_process_quiet
from dhp.config.schema import ModelConfig
from dhp.errors import CheckpointError
from dhp.models import get_family
from dhp.models.chat_templates import named_template
from dhp.models.dtypes import torch_dtype
from dhp.models.tiny_cache import ensure_tiny_checkpoint
from dhp.validation import load_config

# files of a HF model directory that are not weights and are copied from ``model.path`` when set
_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "generation_config.json",
    "spk_dict.pt",  # Qwen2.5-Omni's speaker table: its full model's from_pretrained reads it
)


def _hf_key_map(family, hf_config) -> dict[tuple[str, str], str]:
    """``(module, module_fqn) -> HF key`` from the reference model's state dict (built on meta, no memory)."""
    with torch.device("meta"):
        ref = family.reference_model(hf_config)
    out = {}
    for key, t in ref.state_dict().items():
        for module, sub in family.split_state_dict({key: t}).items():
            for fqn in sub:
                out[(module, fqn)] = key
    return out


def _saved_tensors(module_dir: Path) -> dict[str, TensorStorageMetadata]:
    md = dcp.FileSystemReader(str(module_dir)).read_metadata().state_dict_metadata
    prefix = MODEL_KEY + "."
    return {
        k[len(prefix) :]: m
        for k, m in md.items()
        if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }


def _plan_tensors(ckpt_dir: Path, modules: list[str], key_map, tied: set[tuple[str, str]]):
    """[(hf_key, module, fqn, meta)] for every tensor to export; CheckpointError on any mismatch."""
    todo, problems = [], []
    expected = {k: v for k, v in key_map.items() if k not in tied and k[0] in modules}
    for module in modules:
        saved = _saved_tensors(ckpt_dir / module)
        for fqn, meta in sorted(saved.items()):
            if (module, base_fqn(fqn)) in tied or is_adapter(fqn):  # LoRA adapters: merged or written apart
                continue
            key = expected.pop((module, base_fqn(fqn)), None)
            if key is None:
                problems.append(f"{module}: {fqn} has no place in the HF model")
            else:
                todo.append((key, module, fqn, meta))
    problems += [f"{m}: {f} (HF {k}) missing from the checkpoint" for (m, f), k in sorted(expected.items())]
    if problems:
        raise CheckpointError(
            f"cannot export {ckpt_dir}: {len(problems)} tensor(s) do not match model.* architecture, e.g. "
            f"{problems[:5]}. Fix: export with the model config the checkpoint was trained with."
        )
    return todo


def _read(ckpt_dir: Path, batch, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Read one batch of full tensors (all ranks' shards stitched by DCP) into CPU memory."""
    out = {}
    for module in sorted({m for _, m, _, _ in batch}):
        sd = {
            f"{MODEL_KEY}.{fqn}": torch.empty(meta.size, dtype=meta.properties.dtype)
            for _, m, fqn, meta in batch
            if m == module
        }
        with single_process_quiet():
            dcp.load(sd, checkpoint_id=str(ckpt_dir / module), no_dist=True)
        seen = set()
        for key, m, fqn, _ in batch:
            if m == module:
                t = sd[f"{MODEL_KEY}.{fqn}"]
                t = t.clone() if fqn in seen else t  # a tied tensor the source stores twice
                seen.add(fqn)
                out[key] = t if dtype is None else t.to(dtype)
    return out


def _source_names(
    todo, full: FullSource, *, tied_to: dict[tuple[str, str], str], stored_dims
) -> tuple[list, dict[str, tuple[int, ...]], dict[str, str]]:
    """``todo`` under the full source's keys: (the renamed items, ``{key: dims}`` of tensors the source
    stores in another dimension order (``t.permute(dims)`` is the stored layout), ``{HF key: source
    key}``). A tied tensor the source stores apart is written from its tie target. CheckpointError
    when a trained tensor has no place in the source, or a source tensor of the graph is not trained."""
    names = dict(full.names)
    out, relayout, rename, problems = [], {}, {}, []
    by_fqn = {(m, base_fqn(f)): (m, f, meta) for _, m, f, meta in todo}
    for key, module, fqn, meta in todo:
        src = names.pop((module, base_fqn(fqn)), None)
        if src is None:
            problems.append(f"{module}: {fqn} (HF {key}) has no tensor in the source")
            continue
        rename[key] = src.key
        out.append((src.key, module, fqn, meta))
        if src.shape != tuple(meta.size):
            dims = None if stored_dims is None else stored_dims(fqn, src.shape, tuple(meta.size))
            if dims is None:
                problems.append(f"{src.key}: source shape {list(src.shape)}, trained {list(meta.size)}")
            else:  # the inverse of the loader's permute
                relayout[src.key] = tuple(sorted(range(len(dims)), key=dims.__getitem__))
    for (module, fqn), src in sorted(names.items()):
        target = by_fqn.get((module, tied_to.get((module, fqn), "")))
        if target is not None:
            out.append((src.key, *target))
            names.pop((module, fqn))
    problems += [f"source {s.key} ({m}: {f}) is not in the checkpoint" for (m, f), s in sorted(names.items())]
    if problems:
        raise CheckpointError(
            f"cannot rebuild the full model of {full.carried[0].file.parent}: {len(problems)} tensor(s) "
            f"differ from its layout, e.g. {problems[:5]}. Fix: export with the model.path the run was "
            "trained from."
        )
    return out, relayout, rename


def _trained_batches(todo, dtype: torch.dtype | None, max_bytes: int) -> list[list]:
    """``todo`` cut in order into output shards of at most ``max_bytes`` (after the ``dtype`` cast);
    always one shard at least."""
    shards, cur, size = [], [], 0
    for item in todo:
        nbytes = item[3].size.numel() * (dtype or item[3].properties.dtype).itemsize
        if cur and size + nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += nbytes
    shards.append(cur)
    return shards


def export_hf(
    ckpt_dir: Path,
    *,
    out_dir: Path,
    model: ModelConfig,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 4 << 30,
    on_progress=None,
    lora: dict[str, Any] | None = None,
    lora_mode: str = "merge",
    adapter_base: str | None = None,
) -> Path:
    """Write ``out_dir`` (config.json, safetensors shards + index, tokenizer/processor side files).

    ``model`` is the run's ModelConfig (architecture; ``path`` for the config and side files).
    ``dtype`` casts every trained tensor (None keeps the checkpoint's dtype, e.g. fp32 master weights).
    A full source (``dhp.checkpoint.carried``): its other modules' tensors are copied as stored (never
    cast), after the trained shards, and its ``config.json`` is copied unchanged; trained experts it
    stores per expert are written per expert (cast like every trained tensor).
    ``on_progress(done, total)`` is called after each written shard (the CLI's progress bar).
    ``lora`` (module -> its ``lora`` config) is needed when the checkpoint holds LoRA adapters;
    ``lora_mode``: ``merge`` them into the weights or write peft's ``adapter`` files beside the base
    (``dhp.checkpoint.lora_export``). ``adapter_base``: what ``adapter_config.json`` names as
    ``base_model_name_or_path`` (a hub id, or a path as the adapter will be loaded: e.g. ``..``
    when it is loaded from inside the adapter folder); None: ``out_dir``'s absolute path, which
    loads from anywhere on this machine but not once the export is moved.
    """

    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    meta = read_meta(ckpt_dir)
    family = get_family(model.family)
    if model.path is not None:
        hf_config = family.hf_config_from_dir(model.path, attn_implementation=model.attn_implementation)
    else:
        hf_config = family.hf_config(model)
    modules = sorted(meta.modules)
    tied = {(m, f) for m in modules for f in family.tied_parameters(m, hf_config)}
    key_map = _hf_key_map(family, hf_config)
    todo = _plan_tensors(ckpt_dir, modules, key_map, tied)
    adapters = _adapters(ckpt_dir, modules, key_map, lora=lora, mode=lora_mode)
    full = None if model.path is None else full_source(family, Path(model.path))
    relayout: dict[str, tuple[int, ...]] = {}
    if full is not None:
        tied_to = {(m, f): t for m in modules for f, t in family.tied_parameters(m, hf_config).items()}
        # optional family method: only families whose checkpoints store a tensor re-laid-out
        stored_dims = getattr(family, "stored_dims", None)
        todo, relayout, rename = _source_names(todo, full, tied_to=tied_to, stored_dims=stored_dims)
        if adapters and lora_mode == "adapter":
            # peft names an adapter by the in-memory module path of the model it is loaded onto,
            # which for a full model is neither the thinker's HF key nor the source's stored key
            raise CheckpointError(
                f"{ckpt_dir} holds LoRA adapters and model.path {model.path} is a full model (with "
                f"{full.carried[0].key.split('.')[0]}.*): peft adapter files for it are not written. "
                "Fix: export with --lora merge (the adapters merged into the thinker's weights)."
            )
        adapters = {rename[k]: v for k, v in adapters.items()}  # merged under the source's names
    out_dir.mkdir(parents=True, exist_ok=True)
    plans: list[tuple[str, list]] = [("trained", b) for b in _trained_batches(todo, dtype, max_shard_bytes)]
    if full is not None:
        plans += [("carried", b) for b in batches(full.carried, max_shard_bytes)]
    weight_map, total = {}, 0
    for i, (kind, batch) in enumerate(plans):
        name = f"model-{i + 1:05d}-of-{len(plans):05d}.safetensors"
        tensors = _read(ckpt_dir, batch, dtype) if kind == "trained" else read_carried(batch)
        if kind == "trained" and lora_mode == "merge":
            for key in tensors.keys() & adapters.keys():
                a, b, rank, alpha = adapters[key]
                tensors[key] = merged(tensors[key], a, b, alpha / rank)
        for key in tensors.keys() & relayout.keys():
            tensors[key] = tensors[key].permute(relayout[key]).contiguous()
        if full is not None:  # one fused tensor at a time: its parts replace it before the next is cut
            for key in sorted(tensors.keys() & full.per_expert.keys()):
                tensors.update(full.per_expert[key].split(tensors.pop(key)))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        if on_progress is not None:
            on_progress(i + 1, len(plans))
    index = {
        "metadata": {"total_size": total, "dhp_step": meta.step},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    if adapters and lora_mode == "adapter":
        by_layer = {k.rsplit(".", 1)[0]: v for k, v in adapters.items()}
        # the base weights are out_dir itself (the frozen base as trained, also for a random init)
        write_adapter(
            out_dir / ADAPTER_DIR, by_layer, base_path=adapter_base or str(out_dir.resolve()), dtype=dtype
        )
    if full is not None:  # the full model's config (thinker, talker, ...), as the source has it
        shutil.copy2(Path(model.path) / "config.json", out_dir / "config.json")
    else:
        if dtype is not None:
            hf_config.dtype = dtype
        hf_config.save_pretrained(str(out_dir))
    if model.path is not None:
        for f in _SIDE_FILES:
            if (Path(model.path) / f).is_file():
                shutil.copy2(Path(model.path) / f, out_dir / f)
        family.finish_export(out_dir)  # e.g. a processor class AutoProcessor loads without torchvision
    _as_umask_allows(out_dir)
    return out_dir


def _as_umask_allows(out_dir: Path) -> None:
    """Give every file of the export the mode the user's umask gives a new file (0644 under the usual
    022): safetensors writes its shards 0600, which keeps them from the group that serves the model."""
    mask = os.umask(0)
    os.umask(mask)
    for path in out_dir.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _adapters(ckpt_dir: Path, modules: list[str], key_map, *, lora, mode: str) -> dict[str, tuple]:
    """``{HF base weight key: (A, B, rank, alpha)}`` of every LoRA-adapted layer in the checkpoint."""
    check_mode(mode)
    out = {}
    for module in modules:
        saved = _saved_tensors(ckpt_dir / module)
        if not adapted_layers(saved):
            continue
        if lora is None or module not in lora or lora[module].rank <= 0:
            raise CheckpointError(
                f"{ckpt_dir / module} holds LoRA adapters but no lora config was given for {module!r}. "
                "Fix: export through `dhp export` (it reads the run's config.yaml) or pass lora=."
            )
        alpha = float(lora[module].alpha)
        for layer, (a, b, _) in lora_deltas(ckpt_dir / module, saved, alpha=alpha).items():
            out[key_map[(module, layer + ".weight")]] = (a, b, a.shape[0], alpha)
    return out


def export_checkpoint(
    checkpoint: str | Path,
    *,
    out_dir: str | Path,
    dtype: str | None,
    on_progress=None,
    lora_mode: str | None = None,
    adapter_base: str | None = None,
    say: Callable[[str], None] = print,
) -> tuple[Path, Path]:
    """CLI entry: resolve ``checkpoint`` (a step dir or a run dir), read the run's config.yaml, export.

    Returns (the checkpoint dir exported, the HF dir written). A run that read the tiny checkpoint from
    the cache (``model.tiny``, no ``model.path`` given) gets it rewritten when the cache was cleared
    (its tokenizer and processor files go into the export); ``say`` receives the line naming it.

    The run's resolved ``config.yaml`` sits at ``<run>/config.yaml`` for ``<run>/checkpoints/step_X``.
    """

    ckpt = resolve_checkpoint(
        checkpoint, arg="dhp export CHECKPOINT", other="whose newest complete checkpoint is exported"
    )
    run_config = Path(ckpt).resolve().parent.parent / "config.yaml"
    if not run_config.is_file():
        raise CheckpointError(
            f"{run_config} not found: export reads the model architecture from the run's config.yaml. "
            "Fix: export a checkpoint inside its run directory (runs/<name>/<ts>/checkpoints/step_X)."
        )
    cfg = load_config(str(run_config), [])
    ensure_tiny_checkpoint(cfg.model, say=say)
    cast = None if dtype is None else torch_dtype(dtype)
    lora = {m: c.lora for m, c in cfg.modules.items()}
    out = export_hf(
        Path(ckpt),
        out_dir=Path(out_dir),
        model=cfg.model,
        dtype=cast,
        on_progress=on_progress,
        lora=lora,
        lora_mode=lora_mode or cfg.export.lora,  # the CLI's --lora, else the run's export.lora
        adapter_base=adapter_base,
    )
    write_trained_template(out, cfg.data.chat_template)
    return Path(ckpt), out


def write_trained_template(out_dir: Path, chat_template: str) -> None:
    """The chat template the run trained with goes with the weights: a run with a
    ``data.chat_template`` override writes it as ``chat_template.jinja`` (the checkpoint's own
    template files, copied beside the weights, are replaced by it)."""
    text = named_template(chat_template)
    if text is None:
        return
    (out_dir / "chat_template.json").unlink(missing_ok=True)
    tok = out_dir / "tokenizer_config.json"
    if tok.is_file():
        cfg = json.loads(tok.read_text())
        if cfg.pop("chat_template", None) is not None:
            tok.write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(text)
