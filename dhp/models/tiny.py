"""Tiny, complete HF directories for tests and the demo, made offline in about a second, per family.

``make_tiny_checkpoint(out_dir, family=...)`` writes what a released directory of that family holds:
``config.json``, ``model.safetensors`` (or shards + ``model.safetensors.index.json``), a byte-level BPE
tokenizer trained here with the ``tokenizers`` library (Qwen's special tokens first, so their ids are
fixed: see ``TINY_TOKENS``) and ``preprocessor_config.json``. The parts every family shares are here
(:func:`write_tiny_base`, and :func:`write_tiny_checkpoint`: weights, tokenizer and image processor
without a chat template); a family with files of its own (a processor class, a chat template) has a
``tiny.py`` whose ``write_tiny_checkpoint`` adds them, in its own package or its base's
(:func:`tiny_writer`: ``dhp/models/qwen2_5_vl/tiny.py``, ``dhp/models/qwen3_base/tiny.py``).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from dhp.config.schema import ModelConfig
from dhp.models.common import ExpertFold
from dhp.models.registry import get_family

# Qwen's special tokens, in this order: ids 0..13 in the tiny tokenizer.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TINY_MIN_PIXELS = 56 * 56
TINY_MAX_PIXELS = 448 * 448
SHARD_SIZE = "600KB"  # the tiny fp32 model (~2.7 MB) becomes 5+ shards

_SUBJECTS = ("a cat", "an astronaut", "a rocket", "two coins", "a cup of coffee", "the moon", "a motorcycle")
_VERBS = ("sits on", "floats above", "rests near", "is shown beside", "appears in front of", "lies under")
_PLACES = ("a red sofa", "the earth", "a wooden table", "the launch pad", "a dark sky", "green grass")
_EXTRA = ("The photo is sharp.", "Colors are warm.", "What is in the image?", "Describe the picture.")


def tiny_corpus() -> list[str]:
    """A few hundred deterministic caption-like lines (plus chat turns) to train the tiny BPE."""
    lines = [f"{s.capitalize()} {v} {p}." for s, v, p in itertools.product(_SUBJECTS, _VERBS, _PLACES)]
    lines += [f"{e} {s.capitalize()}, 0123456789." for e, s in itertools.product(_EXTRA, _SUBJECTS)]
    return lines


def train_tiny_tokenizer(*, vocab_size: int) -> Qwen2Tokenizer:
    """Byte-level BPE with Qwen2's pre-tokenizer, trained on :func:`tiny_corpus`; specials get ids 0..13."""
    bpe = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(tiny_corpus(), trainer=trainer)
    merges = [tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
    return Qwen2Tokenizer(
        vocab=bpe.get_vocab(),
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        model_max_length=4096,
    )


def make_tiny_checkpoint(
    out_dir: str | Path,
    *,
    family: str = "qwen2_5_vl",
    sharded: bool = False,
    seed: int = 0,
    model_cfg: ModelConfig | None = None,
) -> Path:
    """Write a complete tiny HF directory of ``family`` (``model_cfg.family`` when given) to ``out_dir``.

    Weights: transformers' own random init under ``seed`` (the caller's RNG is left untouched),
    saved by ``save_pretrained`` in ``model_cfg.dtype`` (default: the family's tiny model);
    ``sharded`` writes several ``model-0000i-of-0000n.safetensors`` files and the index.
    """
    name = model_cfg.family if model_cfg is not None else family
    return tiny_writer(name)(Path(out_dir), family=name, sharded=sharded, seed=seed, model_cfg=model_cfg)


def tiny_writer(family: str):
    """The ``write_tiny_checkpoint`` of ``family``: the ``tiny`` module of its own package, else of
    the package of the nearest base class that has one (a Qwen3-style family's is
    ``dhp.models.qwen3_base.tiny``), else this module's shared parts."""
    for cls in type(get_family(family)).__mro__:
        package = cls.__module__.rpartition(".")[0]
        if not package.startswith("dhp.models"):
            continue
        module = f"{package}.tiny"
        if importlib.util.find_spec(module) is not None:
            return importlib.import_module(module).write_tiny_checkpoint
    return write_tiny_checkpoint


def write_tiny_checkpoint(
    out: Path, *, family: str, sharded: bool, seed: int, model_cfg: ModelConfig | None
) -> Path:
    """The shared tiny parts only (:func:`write_tiny_base`): the tokenizer and the image processor's
    files beside the weights, no chat template (synthetic data only): a family whose tiny model reads
    real data writes its own (:func:`tiny_writer`)."""
    _, tokenizer, image_processor = write_tiny_base(
        out, family=family, sharded=sharded, seed=seed, model_cfg=model_cfg
    )
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    return out


def write_tiny_base(
    out: Path,
    *,
    family: str,
    sharded: bool,
    seed: int,
    model_cfg: ModelConfig | None,
    original_format: bool = True,
) -> tuple[ModelConfig, Qwen2Tokenizer, Qwen2VLImageProcessorPil]:
    """Weights, config.json, the tiny tokenizer and ``preprocessor_config.json`` of ``family``'s tiny
    model (or ``model_cfg``); returns them for the family to add its own files. ``original_format``
    False: the weights as transformers holds them (its ``save_original_format``), not re-laid-out as
    a release stores them (Qwen3.5-MoE's one tensor per expert: :func:`write_per_expert_copy` writes
    that layout of a fused directory, under the release's key names)."""
    fam = get_family(family)
    model_cfg = model_cfg if model_cfg is not None else fam.tiny_model_config()
    out.mkdir(parents=True, exist_ok=True)
    hf_config = fam.hf_config(model_cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = fam.reference_model(hf_config)
    model.save_pretrained(
        out, max_shard_size=SHARD_SIZE if sharded else "50GB", save_original_format=original_format
    )
    tokenizer = train_tiny_tokenizer(vocab_size=model_cfg.llm.vocab_size)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=model_cfg.vision.patch_size,
        merge_size=model_cfg.vision.spatial_merge_size,
        temporal_patch_size=model_cfg.vision.temporal_patch_size,
        min_pixels=TINY_MIN_PIXELS,
        max_pixels=TINY_MAX_PIXELS,
    )
    _check_token_ids(tokenizer, model_cfg)
    return model_cfg, tokenizer, image_processor


def _check_token_ids(tokenizer: Qwen2Tokenizer, model_cfg: ModelConfig) -> None:
    """The tokenizer's special ids must equal ``model_cfg.tokens`` (which the model graph uses)."""
    tok = model_cfg.tokens
    expected = {
        "<|image_pad|>": tok.image_token_id,
        "<|video_pad|>": tok.video_token_id,
        "<|vision_start|>": tok.vision_start_token_id,
        "<|vision_end|>": tok.vision_end_token_id,
        "<|im_end|>": tok.eos_token_id,
        "<|endoftext|>": tok.pad_token_id,
    }
    got = {t: tokenizer.convert_tokens_to_ids(t) for t in expected}
    if got != expected:
        raise ValueError(f"tiny tokenizer ids {got} disagree with model.tokens {expected}")


def write_per_expert_copy(
    src: Path, out: Path, *, folds: Sequence[ExpertFold], rename: Callable[[str], str] | None = None
) -> Path:
    """Copy the directory ``src`` to ``out`` with every fused expert tensor of ``folds`` stored one tensor
    per expert, as a release stores them (``<layer>.<fused>`` [E, ...] -> ``<layer>.<experts>.{j}.<part>``,
    the parts cut in equal sizes on ``fold.dim``, in order), each in the shard that held the fused
    tensor, and every key renamed by ``rename`` (e.g. to a full release's ``thinker.`` names). The other
    files are copied and the index is rewritten; one shard's tensors are in memory at a time. For
    loader tests."""
    out.mkdir(parents=True, exist_ok=True)
    rename = rename or (lambda key: key)
    shards = sorted(src.glob("*.safetensors"))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    weight_map, total = {}, 0
    for shard in shards:
        tensors: dict[str, torch.Tensor] = {}
        for key, t in load_file(str(shard)).items():
            fold = next((fd for fd in folds if key.endswith("." + fd.fused) or key == fd.fused), None)
            if fold is None:
                tensors[rename(key)] = t
                continue
            layer = key[: len(key) - len(fold.fused)]
            sizes = [t.shape[1 + fold.dim] // len(fold.parts)] * len(fold.parts)
            for j in range(t.shape[0]):
                for part, piece in zip(fold.parts, t[j].split(sizes, dim=fold.dim), strict=True):
                    tensors[rename(f"{layer}{fold.experts}.{j}.{part}")] = piece.contiguous()
        save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard.name)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
