"""Checks that need the model's files or token ids: ``model.path`` and ``model.tokens``.

``model.path`` must be a directory with the weights, the tokenizer (and for real data the image
processor) a run reads, and a ``config.json`` whose architecture numbers agree with
``model.vision`` / ``model.llm`` (the planner and the module builders read the YAML numbers, the
weights come from the directory; a mismatch would plan one model and load another). Both the
hub's layout (text fields at the top level) and transformers 5's (``text_config``) are read.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dhp.config.data_shortcuts import is_pending_tiny_checkpoint
from dhp.config.issues import Issues
from dhp.config.validate_guards import validate_model_type

# schema key -> config.json key
_LLM_KEYS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
}
_VISION_KEYS = {
    "depth": "depth",
    "hidden_size": "hidden_size",
    "num_heads": "num_heads",
    "intermediate_size": "intermediate_size",
    "patch_size": "patch_size",
    "spatial_merge_size": "spatial_merge_size",
    "temporal_patch_size": "temporal_patch_size",
}


def validate_tokens(model: DictConfig, issues: Issues) -> None:
    """Every special token id the model reads must be a row of the embedding table (the audio
    placeholders only when the model has an audio encoder, ``model.audio.depth`` > 0)."""
    vocab = model.llm.vocab_size
    for key, value in model.tokens.items():
        if key.startswith("audio_") and model.audio.depth == 0:
            continue
        issues.check(
            0 <= value < vocab,
            f"model.tokens.{key}",
            value,
            f"outside the vocabulary [0, model.llm.vocab_size={vocab})",
            "use the id the model's tokenizer assigns to this token",
        )


def _read_config_json(path: Path, issues: Issues) -> dict | None:
    if not path.is_dir():
        issues.add(
            "model.path",
            str(path),
            "not a directory",
            "point model.path at a local HF model directory (the tiny one: "
            "python scripts/make_tiny_checkpoint.py --out DIR, as `make demo` does), or model.path=null",
        )
        return None
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        issues.add("model.path", str(path), "has no config.json", "save the model with save_pretrained")
        return None
    try:
        return json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        issues.add("model.path", str(cfg_file), f"config.json is unreadable ({err})", "re-save the model")
        return None


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # what dhp.models.loading reads
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # beside tokenizer_config.json's key


def _missing_files(path: Path, issues: Issues, *, real_data: bool) -> None:
    """The files a run reads from ``model.path`` beside config.json: the weights (safetensors, one
    file or an index), the tokenizer with a chat template (the token ids are checked against
    ``model.tokens``, and real data is rendered with the template) and, for real data, the image
    processor's ``preprocessor_config.json``. One issue per missing part."""
    issues.check(
        any((path / f).is_file() for f in WEIGHT_FILES),
        "model.path",
        str(path),
        f"has no weights ({' or '.join(WEIGHT_FILES)})",
        "save the model with save_pretrained (safetensors), or point model.path at the downloaded directory",
    )
    tok_file = path / "tokenizer_config.json"
    if not issues.check(
        tok_file.is_file(),
        "model.path",
        str(path),
        "has no tokenizer (tokenizer_config.json)",
        "save the tokenizer beside the weights (tokenizer.save_pretrained(DIR))",
    ):
        return
    try:
        in_config = bool(json.loads(tok_file.read_text()).get("chat_template"))  # a JSON file's key
    except (OSError, json.JSONDecodeError, AttributeError):
        in_config = False
    issues.check(
        in_config or any((path / f).is_file() for f in CHAT_TEMPLATE_FILES),
        "model.path",
        str(path),
        f"its tokenizer has no chat template (tokenizer_config.json's chat_template, or "
        f"{' / '.join(CHAT_TEMPLATE_FILES)})",
        "save the model's chat template with its tokenizer or processor (save_pretrained)",
    )
    if real_data:
        issues.check(
            (path / "preprocessor_config.json").is_file(),
            "model.path",
            str(path),
            "has no image processor (preprocessor_config.json), which real data needs",
            "save the model's processor beside the weights (processor.save_pretrained(DIR))",
        )


def _compare(node: DictConfig, prefix: str, raw: dict, keys: dict[str, str], issues: Issues) -> None:
    for ours, theirs in keys.items():
        if theirs not in raw:
            continue  # transformers fills a default; nothing to compare
        issues.check(
            node[ours] == raw[theirs],
            f"{prefix}.{ours}",
            node[ours],
            f"model.path's config.json has {theirs}={raw[theirs]}",
            "pick the conf/model entry of this checkpoint, or override the number to match",
        )


def validate_model_dir(
    model: DictConfig, issues: Issues, *, real_data: bool = False, model_types: tuple[str, ...] = ()
) -> None:
    """``model.path`` exists, holds what a run reads from it (:func:`_missing_files`) and its
    config.json agrees with the architecture numbers (its ``model_type`` one of ``model_types``, the
    family's). ``real_data`` (``data.kind=llava``): the run also needs the image processor, and a
    model without a tiny checkpoint needs ``model.path``."""
    if model.path is None:
        issues.check(
            not real_data,
            "model.path",
            None,
            f"real data (data.kind=llava) needs the model's tokenizer and image processor, and "
            f"{model.name} is not a tiny model with a checkpoint to stand in",
            "set model.path=DIR, a local HF directory of this model (config.json, safetensors, "
            "tokenizer with a chat template, preprocessor_config.json)",
        )
        return
    if is_pending_tiny_checkpoint(model):
        return
    path = Path(model.path).expanduser()
    raw = _read_config_json(path, issues)
    if raw is None:
        return
    _missing_files(path, issues, real_data=real_data)

    validate_model_type(model, raw, issues, model_types=model_types)
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    _compare(model.llm, "model.llm", text, _LLM_KEYS, issues)
    if "tie_word_embeddings" in raw:
        _compare(model.llm, "model.llm", raw, {"tie_word_embeddings": "tie_word_embeddings"}, issues)
    _compare_extra(model.llm, "model.llm", text, issues)
    encoder = raw.get("vision_config")
    if isinstance(encoder, dict):
        _compare(model.vision, "model.vision", encoder, _VISION_KEYS, issues)
        _compare_extra(model.vision, "model.vision", encoder, issues)


def _compare_extra(node: DictConfig, prefix: str, raw: dict, issues: Issues) -> None:
    """A family's own numbers (``extra``) named as in config.json must agree with it too."""
    extra = node.extra if "extra" in node else {}
    for key in extra:
        if key not in raw:
            continue
        ours = OmegaConf.to_container(extra[key]) if OmegaConf.is_config(extra[key]) else extra[key]
        issues.check(
            ours == raw[key],
            f"{prefix}.extra.{key}",
            ours,
            f"model.path's config.json has {key}={raw[key]}",
            "pick the conf/model entry of this checkpoint, or override the number to match",
        )
