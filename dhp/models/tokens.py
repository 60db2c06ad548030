"""Qwen's chat tokenizer as the families built on it use it: the special tokens' text, and their ids
in the tiny tokenizer that ``dhp.models.tiny`` writes (its special tokens come first)."""

from __future__ import annotations

from dhp.config.schema import SpecialTokens

#: ``SpecialTokens`` field -> the token's text in Qwen's tokenizers
TOKEN_STRINGS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}

#: Special token ids of the tiny tokenizer written by ``make_tiny_checkpoint`` (specials come first).
TINY_TOKENS = SpecialTokens(
    image_token_id=12,
    video_token_id=13,
    vision_start_token_id=9,
    vision_end_token_id=10,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
