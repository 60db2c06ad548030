"""``messages`` records (LLaMA-Factory / ms-swift, and transformers' chat-template style).

A record is ``{"id"?: str, "messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...],
"images"?: [image, ...]}``. ``content`` is either

- a string, where each ``<image>`` stands for the next entry of ``images`` (LLaMA-Factory, ms-swift), or
- a list of typed parts: ``{"type": "text", "text": str}`` and ``{"type": "image"}`` (the next entry
  of ``images``) or ``{"type": "image", "image": <path>}`` (the image itself), as in transformers'
  chat templates.

An image is a path (relative to the image root) or, in parquet, a ``{"bytes", "path"}`` struct. The
result is the same :class:`~dhp.data.record.Record` as a LLaVA record's (``<image>`` in the text).
"""

from __future__ import annotations

from dhp.data import bad
from dhp.data.record import IMAGE_PLACEHOLDER, ImagesFn, Record

ALLOWED_KEYS = ("id", "messages", "images")
ROLES = ("system", "user", "assistant")
FIX = 'give [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]'


def _bad(loc: str, reason: str, detail: str, fix: str) -> bad.BadSampleError:
    return bad.BadSampleError(location=loc, reason=reason, detail=detail, fix=fix)


def _content_text(content: object, *, i: int, loc: str, inline: list[object]) -> tuple[str, int]:
    """The turn's text with ``<image>`` per image part, and how many parts took the next ``images`` entry.

    Inline images (``{"type": "image", "image": x}``) are appended to ``inline`` as ``(position, x)``.
    """
    if isinstance(content, str):
        return content, content.count(IMAGE_PLACEHOLDER)
    if not isinstance(content, list) or not content:
        raise _bad(loc, bad.BAD_CONVERSATION, f"messages[{i}].content = {content!r}", FIX)
    text, from_list = [], 0
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            if IMAGE_PLACEHOLDER in part["text"]:
                raise _bad(
                    loc,
                    bad.PLACEHOLDER_MISMATCH,
                    f"messages[{i}].content[{k}] is a text part containing {IMAGE_PLACEHOLDER}",
                    'use an {"type": "image"} part for each image',
                )
            text.append(part["text"])
        elif kind == "image":
            value = part.get("image", part.get("path"))
            if value is None:
                from_list += 1
            else:
                inline.append(value)
            text.append(IMAGE_PLACEHOLDER)
        else:
            raise _bad(
                loc,
                bad.BAD_CONVERSATION,
                f"messages[{i}].content[{k}] = {part!r} is neither a text nor an image part",
                'use {"type": "text", "text": ...} or {"type": "image"}',
            )
    return "".join(text), from_list


def validate_messages(raw: object, *, location: str, images: ImagesFn) -> Record:
    """Check one ``messages`` record and return its :class:`Record` (images in placeholder order)."""
    loc = location
    if not isinstance(raw, dict):
        raise _bad(
            loc, bad.MALFORMED_RECORD, f"record is {type(raw).__name__}, not an object", "use a JSON object"
        )
    unknown = sorted(set(raw) - set(ALLOWED_KEYS))
    if unknown:
        raise _bad(loc, bad.UNKNOWN_KEYS, f"unknown keys {unknown}", f"use only {list(ALLOWED_KEYS)}")
    messages = raw.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad(loc, bad.BAD_CONVERSATION, "messages is missing or empty", FIX)
    listed = images(raw.get("images") or None, loc)
    turns: list[tuple[str, str]] = []
    refs: list[object] = []
    used = 0
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or set(msg) - {"role", "content"} or msg.get("role") not in ROLES:
            raise _bad(loc, bad.BAD_CONVERSATION, f"messages[{i}] = {msg!r} is not {{role, content}}", FIX)
        inline: list[object] = []
        text, _ = _content_text(msg.get("content"), i=i, loc=loc, inline=inline)
        n = text.count(IMAGE_PLACEHOLDER)
        if n and msg["role"] != "user":
            raise _bad(
                loc,
                bad.PLACEHOLDER_MISMATCH,
                f"messages[{i}] ({msg['role']}) holds an image",
                "put images in user turns only",
            )
        if not text.replace(IMAGE_PLACEHOLDER, "").strip() and not n:
            raise _bad(loc, bad.BAD_CONVERSATION, f"messages[{i}] has empty content", "remove or fill it")
        # parts keep their order: walk the placeholders, taking inline images or the next listed one
        inline_iter = iter(images(inline, loc) if inline else ())
        parts = msg["content"] if isinstance(msg["content"], list) else [None] * n
        for part in parts:
            if part is not None and part.get("type") != "image":
                continue
            if part is not None and part.get("image", part.get("path")) is not None:
                refs.append(next(inline_iter))
            else:
                if used >= len(listed):
                    raise _bad(
                        loc,
                        bad.PLACEHOLDER_MISMATCH,
                        f"more image placeholders than the {len(listed)} entries of images",
                        f"write one {IMAGE_PLACEHOLDER} (or image part) per entry of images, in order",
                    )
                refs.append(listed[used])
                used += 1
        turns.append((msg["role"], text))
    if used != len(listed):
        raise _bad(
            loc,
            bad.PLACEHOLDER_MISMATCH,
            f"{used} image placeholder(s) for {len(listed)} entries of images",
            f"write one {IMAGE_PLACEHOLDER} (or image part) per entry of images, in order",
        )
    body = turns[1:] if turns[0][0] == "system" else turns
    expected = ["user", "assistant"] * ((len(body) + 1) // 2)
    if not body or [r for r, _ in body] != expected[: len(body)] or body[-1][0] != "assistant":
        raise _bad(
            loc,
            bad.BAD_CONVERSATION,
            f"roles {[r for r, _ in turns]} do not alternate user/assistant ending with assistant",
            FIX,
        )
    return Record(location=loc, images=tuple(refs), turns=tuple(turns))
