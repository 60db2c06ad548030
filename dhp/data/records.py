"""Conversation records in the layouts users already have, read into one :class:`Record`.

One reader serves LLaVA, ShareGPT, LLaMA-Factory (v0 ``sharegpt`` formatting and v1 typed parts) and
ms-swift records, in JSON/JSONL, parquet rows and WebDataset members. A :class:`Layout` says which
keys hold what; the default accepts every peer's names, and a dataset's ``columns``/``tags`` (modelled
on LLaMA-Factory's ``dataset_info.json``) narrow it to exactly the keys given.

What a record holds, and the rules (each chosen to match the peer that writes the layout):

- turns: the first present key of ``messages``/``conversations``; each turn's role under ``role`` or
  ``from`` and its text under ``content`` or ``value``. Or ms-swift's ``conversation`` of ``{human,
  assistant}`` pairs, or an instruction record (``instruction``/``query`` + ``input``, ``output``/
  ``response``, ``history``: LLaMA-Factory's alpaca formatting, ms-swift's alpaca and query-response). Roles ``human``/``user`` -> user,
  ``gpt``/``assistant`` -> assistant, ``system``. A top-level ``system`` string is a system prompt.
- content: a string whose ``<image>``/``<video>`` tags stand for the next entry of the record's
  ``images``/``videos`` (LLaMA-Factory, ms-swift, LLaVA's ``image``/``video``), or a list of typed
  parts: ``{"type": "text", "text"|"value": s}``, ``{"type": "image"}`` (the next listed image) or
  ``{"type": "image"|"image_url", <"image"|"value"|"url"|"path"|"image_url">: x}`` (x itself), and
  the same for ``video``/``video_url`` (transformers' chat templates; LLaMA-Factory v1).
- media without tags: when a record lists more images (videos) than its tags and parts take, the
  missing tags go at the start of the first non-system turn, so the first listed items land there
  (ms-swift's rule; LLaMA-Factory puts a record's media there when it has no tag at all). More tags
  than listed items: refused (``placeholder_mismatch``).
- structure: an optional system turn, then user/assistant alternating and ending with an assistant
  turn, or one assistant turn alone (a pre-training record). Media may sit in user and assistant turns
  (a pre-training caption holds its image); their tokens never carry loss.
- audio: each ``<audio>`` tag (or ``{"type": "audio"}`` part) takes the next path of the record's
  ``audios``/``audio`` (LLaMA-Factory, ms-swift); an ``{"type": "audio"|"audio_url", <key>: path}`` part
  is its own clip. The counts must match (LLaMA-Factory's rule; no untagged audio is placed), else
  ``placeholder_mismatch``. Audio must be files named by path (resolved as images are); audio stored
  inside a table or shard, or inline base64 (``input_audio``), is refused by name.
- ``use_audio_in_video``: a per-record boolean (else the dataset's default, ``Layout``) asking that each
  of the record's videos contribute its own audio track (Qwen2.5-Omni's ``use_audio_in_video``).
- tool turns and a ``tools`` list refuse the record (``bad_conversation``).
- other keys (ids, scores, metadata) are ignored: the record lists them (``Record.ignored``) and the
  dataset logs each new one once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dhp.config.validate_data_layouts import COLUMNS
from dhp.data import bad
from dhp.data.images import ImageRef

# value of a record's image field -> image references (None -> no image)
ImagesFn = Callable[[object, str], tuple[ImageRef, ...]]


@dataclass(frozen=True)
class Record:
    """One validated conversation: ``turns`` are ``(role, text)`` with chat-template role names."""

    location: str
    images: tuple[ImageRef, ...]
    turns: tuple[tuple[str, str], ...]
    videos: tuple[Path, ...] = ()  # a folder of frames or a video file per <video> placeholder
    audios: tuple[Path, ...] = ()  # an audio file per <audio> placeholder, in text order
    use_audio_in_video: bool = False  # each video's own audio track is used too
    ignored: tuple[str, ...] = ()  # the record's top-level keys no reader uses (ids, scores, ...)


log = logging.getLogger("dhp.data")

IMAGE_TAG, VIDEO_TAG, AUDIO_TAG = "<image>", "<video>", "<audio>"
IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, AUDIO_PLACEHOLDER = IMAGE_TAG, VIDEO_TAG, AUDIO_TAG
TAGS = (IMAGE_TAG, VIDEO_TAG, AUDIO_TAG)
MEDIA_KINDS = ("image", "video", "audio")
USE_AUDIO_IN_VIDEO = "use_audio_in_video"  # the record key (and dataset_info.json entry key)
ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
TOOL_ROLES = ("observation", "function_call", "function", "tool", "tool_call", "tool_response")
_PART_VALUE = ("value", "url", "path")  # where a typed media part may hold its item, after its type's name
FIX = 'give [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]'

# value of a record's media field -> references (None -> no media); (value, location)
MediaFn = Callable[[object, str], tuple]


@dataclass(frozen=True)
class Layout:
    """Which keys of a record hold what. Each field lists candidate keys; the first present one is read."""

    messages: tuple[str, ...] = ("messages", "conversations")
    system: tuple[str, ...] = ("system",)
    images: tuple[str, ...] = ("images", "image")
    videos: tuple[str, ...] = ("videos", "video")
    audios: tuple[str, ...] = ("audios", "audio")
    tools: tuple[str, ...] = ("tools",)
    # instruction records (LLaMA-Factory alpaca; ms-swift query/response): user text, its appended
    # input, the assistant's answer, earlier [user, assistant] pairs
    prompt: tuple[str, ...] = ("instruction", "query")
    query: tuple[str, ...] = ("input",)
    response: tuple[str, ...] = ("output", "response")
    history: tuple[str, ...] = ("history",)
    role_tag: tuple[str, ...] = ("role", "from")
    content_tag: tuple[str, ...] = ("content", "value")
    roles: Mapping[str, str] = field(default_factory=lambda: dict(ROLE_NAMES))
    tool_roles: tuple[str, ...] = TOOL_ROLES
    # the dataset's use_audio_in_video for records without the key (dataset_info.json's entry key)
    use_audio_in_video: bool = False

    @property
    def turn_keys(self) -> tuple[str, ...]:
        """Top-level keys that hold a record's turns (in any of the accepted shapes)."""
        return (*self.messages, "conversation", *self.prompt)

    @property
    def read_keys(self) -> set[str]:
        """Top-level keys this layout reads (everything else is ignored and listed)."""
        media = (*self.images, *self.videos, *self.audios, *self.tools)
        turns = (*self.messages, "conversation", *self.prompt, *self.query, *self.response, *self.history)
        return {"id", USE_AUDIO_IN_VIDEO, *self.system, *media, *turns}


def layout_from(columns: Mapping[str, str], tags: Mapping[str, str]) -> Layout:
    """The :class:`Layout` of a LLaMA-Factory-style ``columns``/``tags`` mapping (validated by
    ``dhp.config.validate_data_layouts``): each given column or tag replaces the candidates by that
    one name; role tags map the dataset's role names onto user/assistant/system."""
    base = Layout()
    cols = {k: (v,) for k, v in columns.items() if k in COLUMNS and v}
    roles = dict(base.roles)
    for tag, role in (("user_tag", "user"), ("assistant_tag", "assistant"), ("system_tag", "system")):
        if tags.get(tag):
            roles[tags[tag]] = role
    tool_roles = tuple(tags[t] for t in ("observation_tag", "function_tag") if tags.get(t)) + TOOL_ROLES
    return Layout(
        messages=cols.get("messages", base.messages),
        system=cols.get("system", base.system),
        images=cols.get("images", base.images),
        videos=cols.get("videos", base.videos),
        audios=cols.get("audios", base.audios),
        tools=cols.get("tools", base.tools),
        prompt=cols.get("prompt", base.prompt),
        query=cols.get("query", base.query),
        response=cols.get("response", base.response),
        history=cols.get("history", base.history),
        role_tag=(tags["role_tag"],) if tags.get("role_tag") else base.role_tag,
        content_tag=(tags["content_tag"],) if tags.get("content_tag") else base.content_tag,
        roles=roles,
        tool_roles=tool_roles,
    )


def _bad(loc: str, reason: str, detail: str, fix: str) -> bad.BadSampleError:
    return bad.BadSampleError(location=loc, reason=reason, detail=detail, fix=fix)


def _first(raw: Mapping, keys: tuple[str, ...]) -> tuple[str | None, object]:
    for k in keys:
        if k in raw and raw[k] is not None:
            return k, raw[k]
    return None, None


# A segment of a turn: ("text", str) | ("image" | "video" | "audio", item or None = the next listed one)
Segment = tuple[str, object]


def _split_tags(text: str) -> list[Segment]:
    out: list[Segment] = []
    rest = text
    while rest:
        hits = [(rest.find(t), t) for t in TAGS if t in rest]
        if not hits:
            out.append(("text", rest))
            break
        pos, tag = min(hits)
        if pos:
            out.append(("text", rest[:pos]))
        out.append((tag[1:-1], None))
        rest = rest[pos + len(tag) :]
    return out


def _part(part: object, *, loc: str, where: str) -> Segment:
    """One typed content part -> a segment."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        text = part.get("text", part.get("value"))
        if isinstance(text, str):
            for tag in TAGS:
                if tag in text:
                    raise _bad(
                        loc,
                        bad.PLACEHOLDER_MISMATCH,
                        f"{where} is a text part containing {tag}",
                        f'use a {{"type": "{tag[1:-1]}"}} part for each {tag[1:-1]}',
                    )
            return ("text", text)
    if kind == "input_audio":
        raise _bad(
            loc,
            bad.MALFORMED_RECORD,
            f"{where} is an input_audio part (audio inline in the record, not a file)",
            'write the audio to a file and give {"type": "audio", "audio": PATH} or list it in audios',
        )
    base = kind.removesuffix("_url") if isinstance(kind, str) else None
    if base in MEDIA_KINDS:
        value = None
        for key in (kind, base, *_PART_VALUE):
            if part.get(key) is not None:
                value = part[key]
                break
        if isinstance(value, dict):  # OpenAI style {"image_url": {"url": ...}}
            value = value.get("url")
        return (base, value)
    raise _bad(
        loc,
        bad.BAD_CONVERSATION,
        f"{where} = {str(part)[:80]!r} is not a text, image, video or audio part",
        'use {"type": "text", "text"|"value": ...}, {"type": "image"} or {"type": "image_url", "value": ...}',
    )


def _turn(turn: object, *, i: int, loc: str, layout: Layout) -> tuple[str, list[Segment]]:
    where = f"turn {i}"
    _, role = _first(turn, layout.role_tag) if isinstance(turn, dict) else (None, None)
    ckey, content = _first(turn, layout.content_tag) if isinstance(turn, dict) else (None, None)
    if role is None or ckey is None:
        raise _bad(
            loc,
            bad.BAD_CONVERSATION,
            f"{where} = {str(turn)[:80]!r} has no {'/'.join(layout.role_tag)} and "
            f"{'/'.join(layout.content_tag)}",
            FIX,
        )
    if role in layout.tool_roles:
        raise _bad(
            loc,
            bad.BAD_CONVERSATION,
            f"{where} is a tool turn ({role!r})",
            "drop tool turns; dhp trains user/assistant conversations",
        )
    if role not in layout.roles:
        raise _bad(
            loc,
            bad.BAD_CONVERSATION,
            f"{where} has role {role!r} (known: {sorted(layout.roles)})",
            "map it with the dataset's tags (user_tag, assistant_tag, system_tag)",
        )
    mapped = layout.roles[role]
    weight = turn.get("loss_weight")
    if weight is not None and float(weight) != (1.0 if mapped == "assistant" else 0.0):
        raise _bad(
            loc,
            bad.BAD_CONVERSATION,
            f"{where} ({mapped}) has loss_weight={weight}",
            "dhp puts loss on every assistant turn and on no other: drop the turn or its loss_weight",
        )
    if isinstance(content, str):
        segs = _split_tags(content)
    elif isinstance(content, list) and content:
        segs = [_part(p, loc=loc, where=f"{where} part {k}") for k, p in enumerate(content)]
    else:
        raise _bad(loc, bad.BAD_CONVERSATION, f"{where} has content {str(content)[:80]!r}", FIX)
    if not any(kind != "text" or text.strip() for kind, text in segs):
        raise _bad(loc, bad.BAD_CONVERSATION, f"{where} has empty content", "remove or fill it")
    return mapped, segs


def _listed(value: object, media: MediaFn, loc: str) -> tuple:
    if value is None or value == []:
        return ()
    return media(value, loc)


def normalize(raw: object, *, location: str, layout: Layout, media: MediaFn):
    """Check one raw record in any supported layout and return its :class:`Record`."""
    loc = location
    if not isinstance(raw, dict):
        raise _bad(
            loc, bad.MALFORMED_RECORD, f"record is {type(raw).__name__}, not an object", "use a JSON object"
        )
    turns_raw = _raw_turns(raw, layout=layout, loc=loc)
    _, tools = _first(raw, layout.tools)
    if tools:
        raise _bad(loc, bad.BAD_CONVERSATION, "the record lists tools", "drop tool-use records")
    turns = [_turn(t, i=i, loc=loc, layout=layout) for i, t in enumerate(turns_raw)]
    _, system = _first(raw, layout.system)
    if isinstance(system, str) and system.strip():
        if turns[0][0] == "system":
            raise _bad(loc, bad.BAD_CONVERSATION, "a system key and a system turn", "keep one of them")
        turns.insert(0, ("system", [("text", system)]))
    _check_roles(turns, loc=loc)
    keys = {"image": layout.images, "video": layout.videos, "audio": layout.audios}
    listed = {kind: _listed(_first(raw, keys[kind])[1], media, loc) for kind in MEDIA_KINDS}
    for kind in ("image", "video"):  # untagged audio is not placed: its tags must match (above)
        _place_untagged(turns, kind=kind, n=len(listed[kind]))
    refs = _resolve(turns, listed=listed, media=media, loc=loc)
    texts = tuple(
        (role, "".join(s if kind == "text" else f"<{kind}>" for kind, s in segs)) for role, segs in turns
    )
    videos, audios = tuple(refs["video"]), tuple(refs["audio"])
    if any(not isinstance(v, Path) for v in videos):
        raise _bad(
            loc,
            bad.CORRUPT_VIDEO,
            "a video stored inside the shard or table",
            "keep videos as files (or frame folders) next to the dataset and name them by path",
        )
    if any(not isinstance(a, Path) for a in audios):
        raise _bad(
            loc,
            bad.CORRUPT_AUDIO,
            "an audio stored inside the shard or table",
            "keep audio as files next to the dataset and name them by path",
        )
    return Record(
        location=loc,
        images=tuple(refs["image"]),
        turns=texts,
        videos=videos,
        audios=audios,
        use_audio_in_video=_audio_in_video(raw, layout=layout, loc=loc),
        ignored=tuple(sorted(set(raw) - layout.read_keys)),
    )


def _audio_in_video(raw: Mapping, *, layout: Layout, loc: str) -> bool:
    """The record's ``use_audio_in_video`` (a JSON boolean), else the dataset's default."""
    value = raw.get(USE_AUDIO_IN_VIDEO)
    if value is None:
        return layout.use_audio_in_video
    if not isinstance(value, bool):
        raise _bad(
            loc,
            bad.MALFORMED_RECORD,
            f"{USE_AUDIO_IN_VIDEO} = {str(value)[:40]!r} is not a boolean",
            f"write {USE_AUDIO_IN_VIDEO}: true or false (a JSON boolean, not a string)",
        )
    return value


def _raw_turns(raw: Mapping, *, layout: Layout, loc: str) -> list:
    """The record's turns as written: a ``messages``/``conversations`` list; ms-swift's ShareGPT
    ``conversation`` of ``{human, assistant}`` pairs; or an instruction record (``instruction`` +
    ``input`` -> user, joined by a newline; ``output`` -> assistant; LLaMA-Factory's alpaca and ms-swift's
    ``query``/``response``), each after its ``history`` of ``[user, assistant]`` pairs."""
    mkey, turns = _first(raw, layout.messages)
    if mkey is not None and isinstance(turns, list) and turns:
        return turns
    role, content = layout.role_tag[0], layout.content_tag[0]
    user, assistant = _role_name(layout, "user"), _role_name(layout, "assistant")

    def pair(q: object, a: object) -> list[dict]:
        return [{role: user, content: q}, {role: assistant, content: a}]

    _, pairs = _first(raw, ("conversation",))
    if (
        isinstance(pairs, list)
        and pairs
        and all(isinstance(p, dict) and {"human", "assistant"} <= set(p) for p in pairs)
    ):
        return [t for p in pairs for t in pair(p["human"], p["assistant"])]
    pkey, prompt = _first(raw, layout.prompt)
    _, response = _first(raw, layout.response)
    if pkey is not None and response is not None:
        _, extra = _first(raw, layout.query)
        if isinstance(prompt, str) and isinstance(extra, str) and extra:
            prompt = f"{prompt}\n{extra}" if prompt else extra
        _, history = _first(raw, layout.history)
        out: list = []
        for h in history or []:
            if not (isinstance(h, list) and len(h) == 2):
                raise _bad(
                    loc,
                    bad.BAD_CONVERSATION,
                    f"history entry {str(h)[:60]!r}",
                    "give [[user, assistant], ...]",
                )
            out += pair(*h)
        return out + pair(prompt, response)
    raise _bad(
        loc,
        bad.BAD_CONVERSATION,
        f"no turns under {'/'.join(layout.messages)} (keys: {sorted(raw)[:12]})",
        FIX + "; or map the key with the dataset's columns.messages",
    )


def _role_name(layout: Layout, role: str) -> str:
    """A name the layout maps to ``role`` (the default name when it still maps)."""
    if layout.roles.get(role) == role:
        return role
    return next(k for k, v in layout.roles.items() if v == role)


def _check_roles(turns: list[tuple[str, list[Segment]]], *, loc: str) -> None:
    for role, segs in turns:
        if role == "system" and any(kind != "text" for kind, _ in segs):
            raise _bad(
                loc, bad.PLACEHOLDER_MISMATCH, "the system turn holds media", "put media in user turns"
            )
    roles = [r for r, _ in turns]
    body = roles[1:] if roles[0] == "system" else roles
    expected = ["user", "assistant"] * ((len(body) + 1) // 2)
    if body == ["assistant"]:
        return  # a pre-training record
    if not body or body != expected[: len(body)] or body[-1] != "assistant":
        raise _bad(
            loc,
            bad.BAD_CONVERSATION,
            f"roles {roles} do not alternate user/assistant ending with assistant "
            "(or hold one assistant turn: pre-training)",
            FIX,
        )


def _place_untagged(turns: list[tuple[str, list[Segment]]], *, kind: str, n: int) -> None:
    """Fewer tags/parts taking a listed item of ``kind`` than the ``n`` listed: the missing ones go at
    the start of the first non-system turn (ms-swift's rule; LLaMA-Factory's for a record with no
    tag), so the first listed items land there."""
    tagged = sum(1 for _, segs in turns for k, v in segs if k == kind and v is None)
    if n <= tagged:
        return
    t = 1 if turns[0][0] == "system" else 0
    turns[t] = (turns[t][0], [(kind, None)] * (n - tagged) + turns[t][1])


def _resolve(turns, *, listed: dict[str, tuple], media: MediaFn, loc: str) -> dict[str, list]:
    """Each media segment's reference, in turn order: the next listed item, or its own (inline) one."""
    out: dict[str, list] = {kind: [] for kind in listed}
    used = dict.fromkeys(listed, 0)
    for _, segs in turns:
        for kind, value in segs:
            if kind == "text":
                continue
            if value is None:
                if used[kind] >= len(listed[kind]):
                    raise _mismatch(loc, kind, listed)
                out[kind].append(listed[kind][used[kind]])
                used[kind] += 1
            else:
                out[kind].append(media(value, loc)[0])
    for kind in listed:
        if used[kind] != len(listed[kind]):
            raise _mismatch(loc, kind, listed, used=used[kind])
    return out


def _mismatch(loc: str, kind: str, listed: dict, used: int | None = None) -> bad.BadSampleError:
    tag, n = f"<{kind}>", len(listed[kind])
    detail = (
        f"{used} {tag} tag(s)/part(s) for the {n} listed {kind}(s)"
        if used is not None
        else f"more {tag} tags/parts than the {n} listed {kind}(s)"
    )
    fix = (
        f"write exactly one {tag} (or {kind} part) per listed {kind}, in order"
        if kind == "audio"
        else f"write at most one {tag} (or {kind} part) per listed {kind}, in order (untagged ones go at "
        "the start of the first turn)"
    )
    return _bad(loc, bad.PLACEHOLDER_MISMATCH, detail, fix)


def entry_layout(entry) -> Layout:
    """The :class:`Layout` of a ``data.datasets[]`` entry (its ``columns`` and ``tags``)."""
    return layout_from(dict(entry.columns), dict(entry.tags))


class IgnoredKeys:
    """The top-level keys a dataset's records hold and no reader uses: each new one is logged once
    (``dhp.data``), and ``keys`` lists them all (``dhp data check`` shows them)."""

    def __init__(self, dataset: str) -> None:
        self.dataset = dataset
        self.keys: set[str] = set()

    def note(self, keys: tuple[str, ...]) -> None:
        new = [k for k in keys if k not in self.keys]
        if new:
            self.keys.update(new)
            log.warning("dataset %r: ignoring record key(s) %s (not read by any reader)", self.dataset, new)
