"""Sample sources: the configured datasets as one indexable stream with a seeded per-epoch order.

``build_source`` reads ``data.kind``: ``llava`` mixes the ``data.datasets`` entries (each in any
format of ``dhp.data.formats``: LLaVA or messages JSON/JSONL, parquet/arrow, WebDataset) by weight;
``synthetic`` builds :class:`~dhp.data.synthetic.SyntheticSource`. A source maps a global index to
a location string (for errors) and to a processed :class:`~dhp.data.batch.Sample`.

Mixing weights: ``weight`` is how many times each record of a dataset is seen per epoch. 1.0 = once;
2.0 = twice; 0.5 = a seeded half, drawn afresh each epoch. Nothing else drops records.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from dhp.config.schema import DataConfig, ModelConfig
from dhp.data.audio_sample import AudioSpec
from dhp.data.batch import Sample
from dhp.data.formats import Dataset, open_dataset
from dhp.data.llava import resolve_path
from dhp.data.processing import Limits, SampleProcessor, load_image_processor, load_tokenizer
from dhp.data.synthetic import SyntheticSource
from dhp.data.video import video_spec
from dhp.errors import ConfigError, ConfigIssue
from dhp.models.registry import get_arch, get_family


class SampleSource(Protocol):
    """What the loader and the check need from a source."""

    def __len__(self) -> int: ...

    def location(self, index: int) -> str: ...

    def load(self, index: int) -> Sample: ...


class LlavaSource:
    """Several datasets (any format) behind one index ``0..len-1`` (dataset after dataset)."""

    def __init__(self, *, datasets: list[Dataset], weights: list[float], processor: SampleProcessor) -> None:
        self.datasets = datasets
        self.weights = weights
        self.processor = processor
        self.offsets = [0]
        for ds in datasets:
            self.offsets.append(self.offsets[-1] + len(ds))

    def __len__(self) -> int:
        return self.offsets[-1]

    def _split(self, index: int) -> tuple[Dataset, int]:
        for d, ds in enumerate(self.datasets):
            if index < self.offsets[d + 1]:
                return ds, index - self.offsets[d]
        raise IndexError(index)

    def location(self, index: int) -> str:
        ds, i = self._split(index)
        return ds.location(i)

    def load(self, index: int) -> Sample:
        ds, i = self._split(index)
        return self.processor.process(ds.record(i))


def epoch_order(*, sizes: list[int], weights: list[float], seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The global indices of one epoch: each dataset repeated ``floor(w)`` times plus a seeded
    ``frac(w)`` subset, then shuffled with ``(seed, epoch)`` when ``shuffle``. Pure and deterministic."""
    gen = torch.Generator().manual_seed(seed * 7919 + epoch)
    order: list[int] = []
    offset = 0
    for size, w in zip(sizes, weights, strict=True):
        whole, frac = math.floor(w), w - math.floor(w)
        idx = list(range(offset, offset + size))
        order += idx * whole
        extra = round(frac * size)
        if extra:
            pick = torch.randperm(size, generator=gen)[:extra].sort().values
            order += [offset + int(p) for p in pick]
        offset += size
    if shuffle:
        order = [order[int(p)] for p in torch.randperm(len(order), generator=gen)]
    return order


def build_source(
    *,
    data: DataConfig,
    model: ModelConfig,
    patch_seq_len: int,
    token_seq_len: int,
    seed: int,
    seq_lens: Mapping[str, int] | None = None,
) -> tuple[SampleSource, list[int], list[float]]:
    """The source of ``data`` plus the per-dataset sizes and weights for :func:`epoch_order`.

    ``patch_seq_len``/``token_seq_len`` are the image encoder's and the consumer's ``seq_len``
    (:func:`dhp.models.graph.seq_limits`): per-sample limits (samples over them are bad, never
    truncated). ``seq_lens``: every module's ``seq_len`` (:func:`dhp.models.graph.module_seq_lens`);
    the audio encoder's bounds one sample's mel frames (a sample over it is the bad sample
    ``audio_too_long``; None: unbounded, as for tools that only read records).
    """
    limits = Limits.of(model.family, patch_seq_len, token_seq_len)
    if data.kind == "synthetic":
        # Text ids come from the tokenizer's vocabulary when there is one, else from the model's.
        vocab = model.llm.vocab_size
        if model.path is not None:
            vocab = min(vocab, len(load_tokenizer(model.path, tokens=model.tokens, family=model.family)))
        src = SyntheticSource(
            synthetic=data.synthetic,
            vision=model.vision,
            tokens=model.tokens,
            vocab_size=vocab,
            limits=limits,
            seed=seed,
            audio=synthetic_audio(data, model),
        )
        return src, [len(src)], [1.0]
    if data.kind != "llava":
        raise ConfigError([ConfigIssue("data.kind", data.kind, "must be llava or synthetic", "pick one")])
    issues = []
    if not data.datasets:
        issues.append(
            ConfigIssue("data.datasets", [], "data.kind=llava needs at least one dataset", "add one")
        )
    for i, entry in enumerate(data.datasets):
        if not entry.weight > 0:
            issues.append(
                ConfigIssue(f"data.datasets[{i}].weight", entry.weight, "must be > 0", "remove the entry")
            )
    if model.path is None:
        issues.append(
            ConfigIssue(
                "model.path",
                None,
                f"data.kind=llava needs the tokenizer and image processor, and {model.name} has no tiny "
                "checkpoint to stand in",
                "set model.path=DIR, a local HF directory of this model (config.json, safetensors, "
                "tokenizer, preprocessor_config.json)",
            )
        )
    if issues:
        raise ConfigError(issues)
    restrict = tuple(
        Path(os.path.realpath(resolve_path(r, key="data.restrict_media_to"))) for r in data.restrict_media_to
    )
    datasets = [
        open_dataset(
            entry,
            allow_outside_root=data.allow_outside_root,
            restrict_to=restrict,
            audio_in_video=data.use_audio_in_video,
        )
        for entry in data.datasets
    ]
    processor = SampleProcessor(
        tokenizer=load_tokenizer(
            model.path, tokens=model.tokens, family=model.family, chat_template=data.chat_template
        ),
        image_processor=load_image_processor(model.path, data=data, family=model.family),
        tokens=model.tokens,
        limits=limits,
        train_on=data.train_on,
    )
    if get_arch(model.family).capabilities.video:
        processor.video = video_spec(data, vision=model.vision, image_processor=processor.image_processor)
    else:  # a record with a video is a bad sample, named, before any rank sees it
        processor.video_refusal = (
            f"model family {model.family} does not declare video (no video path proven against "
            "transformers), so a record with a video cannot be trained"
        )
    processor.audio, processor.audio_refusal = audio_spec(data, model, seq_lens)
    src = LlavaSource(datasets=datasets, weights=[e.weight for e in data.datasets], processor=processor)
    return src, [len(d) for d in datasets], [e.weight for e in data.datasets]


@dataclass(frozen=True)
class ItemTokens:
    """Picklable ``frames per audio -> hand-off rows per audio`` of a family's audio producer (shipped
    with the processor to data workers): the family's own ``tokens_per_item``."""

    family: str
    producer: str
    hf_config: Any

    def __call__(self, lens: list[int]) -> list[int]:
        meta = torch.tensor(lens, dtype=torch.long).view(-1, 1)
        return list(get_family(self.family).tokens_per_item(self.producer, self.hf_config, meta))


@dataclass(frozen=True)
class VideoAudioIds:
    """Picklable ``(grid, seconds, audio_tokens) -> ids`` of a video interleaved with its own audio track
    (shipped with the processor to data workers): the family's own ``video_with_audio_ids`` on the
    checkpoint's config (``position_id_per_seconds``, ``seconds_per_chunk``, token ids); None when the
    family does not lay one out."""

    family: str
    hf_config: Any

    def __call__(self, *, grid: tuple[int, int, int], seconds: float, audio_tokens: int) -> list[int] | None:
        return get_family(self.family).video_with_audio_ids(
            self.hf_config, grid=grid, seconds=seconds, audio_tokens=audio_tokens
        )


def audio_spec(
    data: DataConfig, model: ModelConfig, seq_lens: Mapping[str, int] | None = None
) -> tuple[AudioSpec | None, str]:
    """``(spec, refusal)``: how records' audios become the encoder's input when the model has a producer
    of the ``audio_tokens`` layout (its family's feature extractor from ``model.path``; one sample's
    mel frames bounded by that producer's ``seq_len`` in ``seq_lens``, when given), else why a record
    with audio is refused."""
    family = get_family(model.family)
    hf = family.hf_config(model)
    producers = [e.producer for e in family.handoffs_for(hf) if e.layout == "audio_tokens"]
    if not producers:
        return None, (
            f"model family {model.family} has no audio module (an audio encoder), so a record with audio cannot be trained"
        )
    return (
        AudioSpec(
            extractor=family.load_audio_processor(model.path),
            tokens=ItemTokens(model.family, producers[0], hf),
            max_seconds=float(data.max_audio_seconds),
            max_frames=(seq_lens or {}).get(producers[0], sys.maxsize),
            max_frames_key=f"modules.{producers[0]}.seq_len",
            video_with_audio=VideoAudioIds(
                model.family,
                family.hf_config_from_dir(model.path, attn_implementation=model.attn_implementation),
            ),
        ),
        "",
    )


def synthetic_audio(data: DataConfig, model: ModelConfig) -> tuple[int, int] | None:
    """``(mel bins, tokens per synthetic audio)`` of the model's audio encoder (the producer of the
    ``audio_tokens`` layout, its family's ``tokens_per_item``); None without one or without
    ``data.synthetic.audios_per_sample``."""
    if data.synthetic.audios_per_sample <= 0:
        return None
    family = get_family(model.family)
    hf = family.hf_config(model)
    producers = [e.producer for e in family.handoffs_for(hf) if e.layout == "audio_tokens"]
    if not producers:
        return None
    tokens = ItemTokens(model.family, producers[0], hf)([data.synthetic.audio_frames])[0]
    return int(model.audio.num_mel_bins), int(tokens)
