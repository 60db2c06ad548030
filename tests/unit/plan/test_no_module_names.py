"""No file of the planner (``dhp/plan``) names a module: the module graph says which module produces
and which computes the loss, so the code says producer / consumer, never ``vision``, ``llm`` or
``audio``, except in docstrings and comments.

A hit is a string literal (not a docstring) with one of those names as a word (``"modules.llm.gpus"``,
``" vision tok/s"``; a ``_``-joined key such as ``"vision_tokens_per_s"`` is one word, the name of a
quantity, not of a module), or an identifier (a name, attribute, argument, keyword, function or class)
with one of them as a ``_``-separated part (``cand.vision``, ``llm_replicas``). ``ALLOWED`` lists what
the planner shares with code outside it that still names modules: the plan's ``Route`` fields (read by
the runtime), the estimate's ``vision_tokens_per_s`` (read by the CLI, the metrics and tests), a
function kept under its former keywords for the data layer's tests, and a keyword of
``dhp.config.validate_data_keys``; and the workload document's keys counted per file.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PLAN = Path(__file__).resolve().parents[3] / "dhp" / "plan"
NAMES = frozenset({"vision", "llm", "audio"})

#: (file, identifier) -> why it may name a module: interfaces shared with code outside dhp/plan
ALLOWED_IDENTIFIERS = {
    **{
        ("types.py", f): "Route's fields, read by the runtime"
        for f in ("llm_replica", "llm_ranks", "vision_replicas", "vision_ranks")
    },
    **{("render.py", f): "Route's fields" for f in ("llm_replica", "llm_ranks", "vision_ranks")},
    ("schedule.py", "vision_tokens_per_s"): "the estimate's JSON key (CLI, metrics, tests read it)",
    ("estimate.py", "vision_tokens_per_s"): "the estimate's JSON key",
    **{
        ("estimate.py", f): "vision_patches_per_replica, kept under its former keywords for its callers"
        for f in ("vision_patches_per_replica", "llm_replicas", "vision_replicas")
    },
    ("compile.py", "llm_seq_len"): "dhp.config.validate_data_keys.packed_row_tokens' keyword",
}
#: (file, word) -> occurrences in string literals: keys of the workload document (per-sample audio
#: clips, the step's patches) that render.py prints
ALLOWED_WORDS = {
    ("workload.py", "vision"): 1,
    ("workload.py", "audio"): 3,
    ("render.py", "vision"): 1,
    ("render.py", "audio"): 2,
}

_WORD = re.compile(r"[A-Za-z0-9_]+")


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


def _identifiers(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
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


def module_names(source: str) -> tuple[list[str], list[str]]:
    """(identifiers with a module's name as a ``_`` part, module-name words of string literals)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    idents, words = [], []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            words += [w for w in _WORD.findall(node.value) if w in NAMES]
        idents += [i for i in _identifiers(node) if NAMES.intersection(i.split("_"))]
    return idents, words


def test_the_check_finds_names_and_skips_docstrings_and_comments() -> None:
    code = (
        'def f(per, llm_replicas):\n    """The vision module."""\n    # the llm\n'
        '    x = per.vision\n    return per["llm"], f"{per} modules.audio.gpus", "vision_tokens_per_s"\n'
    )
    idents, words = module_names(code)
    assert sorted(idents) == ["llm_replicas", "vision"]
    assert sorted(words) == ["audio", "llm"]


@pytest.mark.parametrize("path", sorted(PLAN.glob("*.py")), ids=lambda p: p.name)
def test_planner_names_no_module(path: Path) -> None:
    idents, words = module_names(path.read_text(encoding="utf-8"))
    stray = sorted({i for i in idents if (path.name, i) not in ALLOWED_IDENTIFIERS})
    assert not stray, f"{path.name} names modules in identifiers {stray}: say producer / consumer"
    allowed = {w: n for (f, w), n in ALLOWED_WORDS.items() if f == path.name}
    assert dict(Counter(words)) == allowed, f"{path.name}: module names in string literals"
