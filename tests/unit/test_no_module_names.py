"""Nothing outside the families' folders (``dhp/models/<family>/``) names a module: each family declares
its modules (``FamilyArch.module_names``, producers first, the consumer that computes the loss last), so
the generic code says producer / consumer, or iterates over ``cfg.modules``, never ``vision``, ``llm`` or
``audio``. Docstrings and comments may name them.

What counts as naming a module, in every ``.py`` file of ``dhp/`` except ``dhp/models/<folder>/`` (the
families and the model code they share; ``dhp/models/*.py`` is generic and checked):

- an identifier (a name, attribute, argument, keyword, function or class) with ``vision`` or ``llm`` as a
  ``_``-separated part (``cand.vision``, ``llm_replicas``), unless it is one of ``VOCABULARY`` (names
  transformers or the data contract own, such as ``vision_config``);
- a module picked by name: an item ``x["vision"]`` or a test ``"llm" in x`` with a module's name as the
  whole string (or a ``.get`` of it), and ``audio`` picked from something per module
  (``cfg.modules.audio``, ``mods["audio"]``, ``"audio" in layouts``);
- a module's name as a word of a string literal (``"modules.llm.gpus"``, ``" vision tok/s"``; a ``_``-joined
  key such as ``"vision_tokens_per_s"`` is one word, the name of a quantity, not of a module).

Not a module's name (data-format vocabulary and the schema's sections):

- ``audio`` as a part of an identifier, and as a word of strings in ``dhp/data/``, is the media kind, like
  ``image`` and ``video`` (``audio_features``, ``<audio>`` tags, ``{"type": "audio"}`` chat parts, the
  ``audio`` keys of LLaMA-Factory / ms-swift records, bad-sample kinds);
- ``model.vision`` / ``model.llm`` / ``model.audio``: the schema's architecture sections, read as an
  attribute of something called ``model`` (or ``model_cfg``) or written ``model.<section>`` in a
  string.

The ``generic-code`` import contract (pyproject.toml, ``lint-imports``) keeps the same files from
importing a family's folder, through which they could reach its module names.

``ALLOWED_IDENTIFIERS`` and ``ALLOWED_WORDS`` list, per file and with the reason, what is still named:
interfaces shared with code outside the file, schema sections and fixed metric names.
"""

from __future__ import annotations

import ast
import pkgutil
import re
from collections import Counter
from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.unit

DHP = Path(__file__).resolve().parents[2] / "dhp"
NAMES = frozenset({"vision", "llm", "audio"})
#: identifier parts that name a module (``audio`` in an identifier is the media kind)
IDENT_NAMES = frozenset({"vision", "llm"})

#: identifiers owned by transformers, or fixed metric names: names of things, not of modules
VOCABULARY = {
    "vision_config": "transformers' sub-config attribute",
    "vision_start_token_id": "transformers' token id attribute (SpecialTokens)",
    "vision_end_token_id": "transformers' token id attribute (SpecialTokens)",
    "get_vision_position_ids": "transformers' method",
    "tokens_per_s_vision": "a fixed metric name (metrics.jsonl): image patches per second",
}

#: (path under dhp/, identifier) -> why it may name a module
ALLOWED_IDENTIFIERS: dict[tuple[str, str], str] = {
    ("plan/render.py", "vision"): "the workload document's key (the step's patches)",
    ("plan/schedule.py", "vision_tokens_per_s"): "the estimate's JSON key (CLI, metrics, tests read it)",
    ("plan/estimate.py", "vision_tokens_per_s"): "the estimate's JSON key",
    **{
        ("plan/estimate.py", f): "vision_patches_per_replica, kept under its former keywords for its callers"
        for f in ("vision_patches_per_replica", "llm_replicas", "vision_replicas")
    },
    ("data/source.py", "vision"): "the keyword of video_spec / SyntheticSource for model.vision",
    ("data/synthetic.py", "vision"): "SyntheticSource's keyword for model.vision, passed by source.py",
    ("data/video.py", "vision"): "video_spec's keyword for model.vision, passed by source.py",
    ("config/schema.py", "vision"): "ModelConfig's section model.vision, defined here",
    ("config/schema.py", "llm"): "ModelConfig's section model.llm, defined here",
    ("models/checks.py", "check_vision_inputs"): "the image-input check the shared vision encoders call",
    ("models/common.py", "vision"): "vl_config's keyword for transformers' vision_config",
    **{
        ("models/testing.py", f): "the single-process reference of a vision -> LLM pair (parity tests)"
        for f in ("vision", "llm")
    },
}
#: (path under dhp/, word) -> occurrences in string literals, and why
ALLOWED_WORDS: dict[tuple[str, str], tuple[int, str]] = {
    ("plan/workload.py", "vision"): (1, "a key of the workload document (the step's patches)"),
    ("plan/workload.py", "audio"): (3, "keys of the workload document (per-sample audio clips)"),
    ("plan/render.py", "vision"): (1, "the workload document's key, printed"),
    ("plan/render.py", "audio"): (2, "the workload document's keys, printed"),
    **{
        ("checkpoint/compat.py", w): (1, "a schema section's key of the architecture hash checkpoints store")
        for w in ("vision", "llm")
    },
    **{
        ("config/data_shortcuts.py", w): (n, "a schema section's key of the tiny checkpoint's digest")
        for w, n in (("vision", 1), ("llm", 1), ("audio", 2))
    },
    ("data/lengths.py", "vision"): (1, "the schema section's key of the length cache's digest"),
    **{
        ("config/loader.py", w): (1, "a schema section whose extra keys pick the tiny model file")
        for w in ("vision", "llm")
    },
    **{
        ("config/constants.py", w): (1, "MODULE_NAMES: the modules messages assume before a family is known")
        for w in ("vision", "llm")
    },
    ("config/hydra_errors.py", "vision"): (3, "compose errors, before any family is known: examples"),
    ("config/hydra_errors.py", "llm"): (1, "compose errors, before any family is known: an example"),
    ("metrics/report.py", "vision"): (2, "labels of the fixed metric tokens_per_s_vision"),
    ("runtime/loop/progress.py", "vision"): (1, "the label of the fixed metric tokens_per_s_vision"),
    ("models/checks.py", "vision"): (1, "'a vision-language checkpoint': a kind of model"),
    ("models/family_base.py", "vision"): (
        2,
        "FamilyBase's default declaration: a vision -> LLM family's modules",
    ),
    ("models/family_base.py", "llm"): (3, "FamilyBase's default declaration and checkpoint keys"),
    **{
        ("models/testing.py", w): (1, "the reference's gradients per module (parity tests)")
        for w in ("vision", "llm")
    },
}

_WORD = re.compile(r"[A-Za-z0-9_]+")
_PER_MODULE = ("modules", "mods", "layouts")
_SCHEMA_SECTION = re.compile(r"\bmodel\.(vision|llm|audio)\b")


def checked_files() -> list[Path]:
    """Every ``.py`` file of dhp/ outside the folders of dhp/models/."""
    out = []
    for path in sorted(DHP.rglob("*.py")):
        rel = path.relative_to(DHP)
        if rel.parts[0] == "models" and len(rel.parts) > 2:
            continue
        out.append(path)
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    """Ids of every docstring node, and of bare string statements (attribute docstrings)."""
    out = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            out.add(id(node.value))
    return out


def _is_model(node: ast.AST) -> bool:
    """``model``, ``model_cfg`` or ``<x>.model``: the receiver of a schema section."""
    return (isinstance(node, ast.Name) and node.id in ("model", "model_cfg")) or (
        isinstance(node, ast.Attribute) and node.attr == "model"
    )


def _identifiers(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        if node.attr in NAMES and _is_model(node.value):
            return []
        return [node.attr]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.keyword) and node.arg:
        return [node.arg]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.alias):
        return [node.asname or node.name.rsplit(".", 1)[-1]]
    return []


def _name_const(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES:
        return node.value
    return None


def _is_modules(node: ast.AST) -> bool:
    """Something that holds one entry per module: ``modules``, ``mods``, ``layouts`` or ``<x>.modules``."""
    return (isinstance(node, ast.Name) and node.id in _PER_MODULE) or (
        isinstance(node, ast.Attribute) and node.attr in _PER_MODULE
    )


def _picks(node: ast.AST) -> list[str]:
    """Module names used to pick a module: ``cfg.modules.audio``, ``x["llm"]``, ``"vision" in x``
    (``audio`` only from something per module: elsewhere it picks a media kind)."""
    if isinstance(node, ast.Attribute) and node.attr == "audio" and _is_modules(node.value):
        return [node.attr]
    if isinstance(node, ast.Subscript):
        key, box = node.slice, node.value
    elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
        key, box = node.left, node.comparators[0]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        if not node.args:
            return []
        key, box = node.args[0], node.func.value
    else:
        return []
    name = _name_const(key)
    if name is None or _is_model(box) or (name == "audio" and not _is_modules(box)):
        return []
    return [name]


def module_names(source: str, *, media_audio: bool = False) -> tuple[list[str], list[str]]:
    """(identifiers and picks that name a module, module-name words of string literals).

    ``media_audio``: the word ``audio`` in string literals is the media kind (the data layer)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    idents, words = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = _SCHEMA_SECTION.sub("model.section", node.value)
            words += [w for w in _WORD.findall(text) if w in NAMES and not (media_audio and w == "audio")]
        idents += [
            i for i in _identifiers(node) if IDENT_NAMES.intersection(i.split("_")) and i not in VOCABULARY
        ]
        idents += _picks(node)
    return idents, words


def test_the_check_finds_names_and_skips_docstrings_and_comments() -> None:
    code = (
        'def f(per, llm_replicas):\n    """The vision module."""\n    # the llm\n'
        '    x = per.vision\n    return per["llm"], f"{per} modules.audio.gpus", "vision_tokens_per_s"\n'
    )
    idents, words = module_names(code)
    assert sorted(idents) == ["llm", "llm_replicas", "vision"]
    assert sorted(words) == ["audio", "llm"]


def test_the_check_finds_a_module_picked_by_name_in_the_data_layer() -> None:
    code = (
        "def f(cfg, mods):\n"
        '    a = cfg.modules["llm"].seq_len\n'
        '    b = mods.audio.seq_len if "audio" in mods else 0\n'
        '    c = cfg.modules["audio"], cfg.modules.get("audio")\n'
        "    return a, b, c\n"
    )
    idents, words = module_names(code, media_audio=True)
    assert sorted(idents) == ["audio", "audio", "audio", "audio", "llm"]
    assert words == ["llm"]


def test_the_check_skips_media_kinds_and_schema_sections() -> None:
    code = (
        "def f(cfg, model, sample):\n"
        "    v, a = cfg.model.vision.patch_size, model.audio.depth\n"
        '    msg = f"model.llm.vocab_size={model.llm.vocab_size}"\n'
        '    part = {"type": "audio", "audio": sample.audio_features}\n'
        "    return v, a, msg, part, sample.vision_config\n"
    )
    assert module_names(code, media_audio=True) == ([], [])
    assert module_names(code) == ([], ["audio", "audio"])


def test_a_module_name_added_to_the_data_loader_fails_the_check() -> None:
    path = DHP / "data" / "loader.py"
    source = path.read_text(encoding="utf-8") + '\n\ndef _row(cfg):\n    return cfg.modules["llm"].seq_len\n'
    assert _stray(path, source)


def _stray(path: Path, source: str) -> list[str]:
    rel = path.relative_to(DHP).as_posix()
    idents, words = module_names(source, media_audio=rel.startswith("data/"))
    out = [f"identifier {i}" for i in sorted({i for i in idents if (rel, i) not in ALLOWED_IDENTIFIERS})]
    allowed = {w: n for (f, w), (n, _) in ALLOWED_WORDS.items() if f == rel}
    if dict(Counter(words)) != allowed:
        out.append(f"string words {dict(Counter(words))} (allowed: {allowed})")
    return out


def test_every_allowance_names_a_checked_file() -> None:
    files = {p.relative_to(DHP).as_posix() for p in checked_files()}
    assert not {f for f, _ in [*ALLOWED_IDENTIFIERS, *ALLOWED_WORDS]} - files


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: p.relative_to(DHP).as_posix())
def test_generic_code_names_no_module(path: Path) -> None:
    stray = _stray(path, path.read_text(encoding="utf-8"))
    assert not stray, (
        f"dhp/{path.relative_to(DHP).as_posix()} names modules: {stray}; say producer / consumer"
    )


def test_the_import_contract_keeps_every_generic_file_off_the_families_folders() -> None:
    """The ``generic-code`` contract (``lint-imports``) covers every package of dhp but dhp.models and
    every generic file of dhp/models, and forbids every folder of dhp/models: a generic file that
    imported a family's code would name its modules through it."""
    data = tomllib.loads((DHP.parent / "pyproject.toml").read_text(encoding="utf-8"))
    contract = {c["id"]: c for c in data["tool"]["importlinter"]["contracts"]}["generic-code"]
    top = {f"dhp.{m.name}" for m in pkgutil.iter_modules([str(DHP)]) if m.name not in ("__main__", "models")}
    models = list(pkgutil.iter_modules([str(DHP / "models")]))
    generic = {f"dhp.models.{m.name}" for m in models if not m.ispkg}
    folders = {f"dhp.models.{m.name}" for m in models if m.ispkg}
    assert set(contract["source_modules"]) == top | generic
    assert set(contract["forbidden_modules"]) == folders
