"""Sample processing: images through the model family's image processor, text through the chat
template (the checkpoint's own, or ``data.chat_template``), labels on assistant turns only (or on
every text token, ``data.train_on=all``), image tokens expanded to their merged count.

Built offline from a local HF model directory (tokenizer files + ``preprocessor_config.json``). The
family gives the image processor (``family.load_image_processor``) and the special tokens' text
(``family.token_strings()``); ``data.min_pixels``/``data.max_pixels`` override the directory's values. Every limit is
checked before the expensive work and never truncates: a sample over a limit is a bad sample.
"""

from __future__ import annotations

import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from dhp.config.schema import DataConfig, SpecialTokens
from dhp.data import bad
from dhp.data.audio_sample import with_audio
from dhp.data.batch import IGNORE_INDEX, IMAGE, TEXT, Sample
from dhp.data.images import open_image
from dhp.data.llava import Record
from dhp.errors import ConfigError, ConfigIssue, DataError
from dhp.models.chat_templates import OWN, named_template, template_names
from dhp.models.graph import consumer_name, image_module
from dhp.models.registry import get_family


@dataclass(frozen=True)
class Limits:
    """Per-sample limits: the image encoder's patches and the consumer's tokens (each module's
    ``seq_len``). ``patch_key``/``token_key``: those config keys, which bad-sample messages name
    (:meth:`of` fills them from the family's graph)."""

    patch_seq_len: int
    token_seq_len: int
    patch_key: str = "modules.<image encoder>.seq_len"
    token_key: str = "modules.<consumer>.seq_len"

    @classmethod
    def of(cls, family: str, patch_seq_len: int, token_seq_len: int) -> Limits:
        """The limits with the config keys of ``family``'s image encoder and consumer."""
        return cls(
            patch_seq_len,
            token_seq_len,
            patch_key=f"modules.{image_module(family)}.seq_len",
            token_key=f"modules.{consumer_name(family)}.seq_len",
        )

    def broken(self, *, patches: int = 0, tokens: int = 0) -> list[str]:
        """The bad-sample reasons of a sample of ``patches`` encoder patches and ``tokens`` LLM tokens
        (vision first): the one rule the processor raises on and the start-up checks report in full."""
        return [
            reason
            for reason, over in (
                (bad.VISION_TOO_LONG, patches > self.patch_seq_len),
                (bad.TEXT_TOO_LONG, tokens > self.token_seq_len),
            )
            if over
        ]


#: no per-sample limit: the start-up checks measure every sampled row, then compare with the run's
UNBOUNDED = Limits(patch_seq_len=sys.maxsize, token_seq_len=sys.maxsize)


def load_tokenizer(model_path: str, *, tokens: SpecialTokens, family: str, chat_template: str = OWN):
    """The model directory's tokenizer, with its special-token ids checked against ``model.tokens``
    (the token texts come from model family ``family``) and its chat template: the directory's own
    (``chat_template="checkpoint"``) or the one ``data.chat_template`` names
    (:mod:`dhp.models.chat_templates`)."""
    from transformers import AutoTokenizer

    if not (Path(model_path) / "tokenizer_config.json").is_file():
        raise DataError(
            f"model.path {model_path} has no tokenizer_config.json. Fix: point model.path at an HF "
            "directory with the tokenizer (scripts/make_tiny_checkpoint.py writes one)"
        )
    tok = AutoTokenizer.from_pretrained(model_path)
    named = _named_template(chat_template)
    if named is not None:
        tok.chat_template = named
    if tok.chat_template is None:
        raise DataError(
            f"the tokenizer in {model_path} has no chat template (no chat_template.jinja, none in "
            "tokenizer_config.json). Fix: name one, e.g. data.chat_template=chatml "
            f"(one of {', '.join(template_names()[1:])}, or a .jinja file), or add it to the directory"
        )
    issues = []
    for field_name, token in get_family(family).token_strings().items():
        got = tok.convert_tokens_to_ids(token)
        want = getattr(tokens, field_name)
        if got != want:
            issues.append(
                ConfigIssue(
                    path=f"model.tokens.{field_name}",
                    value=want,
                    rule=f"the tokenizer in {model_path} maps {token} to {got}",
                    fix=f"set model.tokens.{field_name}={got} or use the matching tokenizer",
                )
            )
    if issues:
        raise ConfigError(issues)
    return tok


def _named_template(name: str) -> str | None:
    """The text of ``data.chat_template`` (None: the checkpoint's own); ConfigError naming the key
    when the name is unknown or its file unreadable."""
    try:
        return named_template(name)
    except KeyError:
        rule = f"unknown template; known: {', '.join(template_names())}, or a .jinja file"
    except OSError as e:
        rule = f"cannot read the template file ({e.strerror or e})"
    raise ConfigError([ConfigIssue("data.chat_template", name, rule, "name a template or a readable .jinja")])


def template_source(model_path: str, chat_template: str) -> str:
    """Where the chat template of a run comes from, as ``dhp data check --show`` states it."""
    if chat_template != OWN:
        return f"data.chat_template={chat_template}"
    own = (
        "chat_template.jinja"
        if (Path(model_path) / "chat_template.jinja").is_file()
        else "tokenizer_config.json"
    )
    return f"the checkpoint's own ({own})"


def load_image_processor(model_path: str, *, data: DataConfig, family: str):
    """Model family ``family``'s image processor from ``preprocessor_config.json``, with config pixel bounds."""
    if not (Path(model_path) / "preprocessor_config.json").is_file():
        raise DataError(
            f"model.path {model_path} has no preprocessor_config.json. Fix: add the model's image "
            "processor config (scripts/make_tiny_checkpoint.py writes one)"
        )
    if not 0 < data.min_pixels <= data.max_pixels:
        raise ConfigError(
            [
                ConfigIssue(
                    "data.min_pixels",
                    data.min_pixels,
                    "must satisfy 0 < min_pixels <= max_pixels",
                    "fix the bounds",
                )
            ]
        )
    return get_family(family).load_image_processor(
        model_path, min_pixels=data.min_pixels, max_pixels=data.max_pixels
    )


class SampleProcessor:
    """Turns a :class:`~dhp.data.llava.Record` into a :class:`~dhp.data.batch.Sample`.

    Placement: runs on the driver (or a data worker), once per sample per step; the tensors it
    returns are CPU tensors that the runtime ships to the sample's DP replica.
    """

    video = None  # dhp.data.video.VideoSpec for records with videos (set by dhp.data.source)
    video_refusal = ""  # why records with videos are refused (the model family declares no video)
    audio = None  # dhp.data.audio_sample.AudioSpec for records with audios (set by dhp.data.source)
    audio_refusal = ""  # why records with audios are refused (the model has no audio encoder)

    def __init__(
        self,
        *,
        tokenizer,
        image_processor,
        tokens: SpecialTokens,
        limits: Limits,
        train_on: str = "assistant",
    ) -> None:
        self.tokenizer = tokenizer
        self.train_on = train_on  # data.train_on: assistant turns only, or every text token
        self.image_processor = image_processor
        self.tokens = tokens
        self.limits = limits
        self.merge = int(image_processor.merge_size)
        # HF tokenizers mutate backend state per call ("Already borrowed" under threads): serialise
        # the text part (about 1-2 ms a sample); image decoding and processing run in parallel.
        self._text_lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Picklable (shipped once to Ray data workers): the lock is recreated on arrival."""
        state = dict(self.__dict__)
        state["_text_lock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._text_lock = threading.Lock()

    def process(self, record: Record) -> Sample:
        """Load images, render and tokenize the conversation, expand image tokens, check the limits;
        then the audios (``dhp.data.audio_sample``: their frames, their tokens expanded)."""
        return with_audio(self, record, self._visual(record))

    def _visual(self, record: Record) -> Sample:
        """The sample of ``record``'s text, images and videos (audio placeholders left as one token)."""
        loc = record.location
        if record.videos:  # frames -> temporal patches, image and video items in token order
            from dhp.data.video_sample import process_with_videos

            return process_with_videos(self, record)
        images = [open_image(p, loc=loc) for p in record.images]
        patches = [self.image_processor.get_number_of_image_patches(im.height, im.width) for im in images]
        if self.limits.broken(patches=sum(patches)):
            raise bad.BadSampleError(
                location=loc,
                reason=bad.VISION_TOO_LONG,
                detail=f"{sum(patches)} patches {patches} > {self.limits.patch_key}={self.limits.patch_seq_len}",
                fix=f"raise {self.limits.patch_key}, lower data.max_pixels, or drop images",
            )
        with self._text_lock:
            ids, labels, text_chars = self._tokenize(record)
        counts = [p // (self.merge**2) for p in patches]
        ids, labels, types = self._expand_images(ids, labels, counts, loc=loc)
        if self.limits.broken(tokens=ids.numel()):
            raise bad.BadSampleError(
                location=loc,
                reason=bad.TEXT_TOO_LONG,
                detail=f"{ids.numel()} tokens ({sum(counts)} image) > {self.limits.token_key}={self.limits.token_seq_len}",
                fix=f"raise {self.limits.token_key}, lower data.max_pixels, or shorten the conversation",
            )
        pixel_values = grid = None
        if images:
            try:
                out = self.image_processor(images=images, return_tensors="pt")
            except (ValueError, OSError, TypeError) as e:
                raise bad.BadSampleError(
                    location=loc,
                    reason=bad.CORRUPT_IMAGE,
                    detail=f"the image processor rejects {[getattr(p, 'name', str(p)) for p in record.images]} ({e})",
                    fix="re-encode the images as RGB JPEG or PNG",
                ) from e
            pixel_values = out["pixel_values"].to(torch.float32)
            grid = out["image_grid_thw"].to(torch.long)
            if grid.prod(dim=1).tolist() != patches:
                raise DataError(
                    f"{loc}: image processor gave grids {grid.tolist()}, expected {patches} patches"
                )
        return Sample(
            sample_id=loc,
            input_ids=ids,
            labels=labels,
            mm_token_type_ids=types,
            pixel_values=pixel_values,
            image_grid_thw=grid,
            text_chars=text_chars,
        )

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _tokenize(self, record: Record) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Render with the chat template; label the tokens inside assistant turns (content + end
        token), or every token (``train_on="all"``; the image and video positions lose theirs when
        they are expanded)."""
        messages = [_message(role, text) for role, text in record.turns]
        full = self._render(messages, generation_prompt=False)
        if self.train_on == "all":
            ids = torch.tensor(self.tokenizer(full, add_special_tokens=False)["input_ids"], dtype=torch.long)
            return ids, ids.clone(), len(full)
        spans = []
        for i, (role, _) in enumerate(record.turns):
            if role != "assistant":
                continue
            # the text before turn i's content: its content swapped for a marker (a turn may be the
            # first one, as in an assistant-only pre-training record, so no generation prompt is used)
            probe = [*messages[:i], {"role": role, "content": _TURN_MARK}]
            prefix = self._render(probe, generation_prompt=False).split(_TURN_MARK)[0]
            upto = self._render(messages[: i + 1], generation_prompt=False)
            if not (full.startswith(prefix) and full.startswith(upto) and len(prefix) < len(upto)):
                raise DataError(
                    f"{record.location}: the chat template does not render turn prefixes as prefixes, so "
                    "assistant spans cannot be located. Fix: use a template whose output grows turn by turn"
                )
            spans.append((len(prefix), len(upto.rstrip())))
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = torch.tensor(enc["input_ids"], dtype=torch.long)
        labels = torch.full_like(ids, IGNORE_INDEX)
        for t, (start, end) in enumerate(enc["offset_mapping"]):
            if any(a <= start < b and end <= b for a, b in spans):
                labels[t] = ids[t]
        return ids, labels, len(full)

    def _expand_images(
        self, ids: torch.Tensor, labels: torch.Tensor, counts: list[int], *, loc: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Repeat the k-th image pad token ``counts[k]`` times; mark those positions IMAGE in the types."""
        pad = self.tokens.image_token_id
        where = (ids == pad).nonzero().flatten().tolist()
        if len(where) != len(counts):
            raise bad.BadSampleError(
                location=loc,
                reason=bad.PLACEHOLDER_MISMATCH,
                detail=f"rendered text has {len(where)} image pad tokens for {len(counts)} image(s)",
                fix="remove literal image and video special tokens from the text",
            )
        pieces_ids, pieces_lab, pieces_typ, prev = [], [], [], 0
        for pos, n in zip(where, counts, strict=True):
            pieces_ids += [ids[prev:pos], torch.full((n,), pad, dtype=torch.long)]
            pieces_lab += [labels[prev:pos], torch.full((n,), IGNORE_INDEX, dtype=torch.long)]
            pieces_typ += [
                torch.full((pos - prev,), TEXT, dtype=torch.long),
                torch.full((n,), IMAGE, dtype=torch.long),
            ]
            prev = pos + 1
        pieces_ids.append(ids[prev:])
        pieces_lab.append(labels[prev:])
        pieces_typ.append(torch.full((ids.numel() - prev,), TEXT, dtype=torch.long))
        return torch.cat(pieces_ids), torch.cat(pieces_lab), torch.cat(pieces_typ)


_TURN_MARK = "\x00dhp-turn-content\x00"  # never in real text; marks where a turn's content starts


_TAGS = ("<image>", "<video>", "<audio>")


def _message(role: str, text: str) -> dict:
    """A chat-template message; ``<image>`` / ``<video>`` / ``<audio>`` placeholders become
    ``{"type": "image"}`` / ``{"type": "video"}`` / ``{"type": "audio"}`` content parts."""
    if not any(tag in text for tag in _TAGS):
        return {"role": role, "content": text}
    parts: list[dict] = []
    for chunk in re.split(r"(<image>|<video>|<audio>)", text):
        if chunk in _TAGS:
            parts.append({"type": chunk[1:-1]})
        elif chunk:
            parts.append({"type": "text", "text": chunk})
    return {"role": role, "content": parts}
