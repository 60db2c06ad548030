"""Imports sit at the top of a module; one inside a function says why in a comment.

An import inside a function hides a dependency from a reader and from ``lint-imports`` alike, and is
the usual way a cycle between two files stays unseen. It is allowed for a stated reason (a heavy or
optional dependency, a process that must not load Ray, a command that should start fast), written as a
comment on the import line or on the comment lines right above its group of imports.

``UNREVIEWED`` counts, per file, the imports inside functions that carry no such comment yet. A file
may only go down: hoist the import, or write the reason, and lower the number (0 drops the entry).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

#: Files whose every function-level import has one stated reason, given here once.
WHOLE_FILE_REASONS = {
    # each command imports its library inside its body: `dhp --help` and shell completion load no
    # torch, Ray or transformers (the module docstring says so)
    "dhp/cli.py",
}

UNREVIEWED = {
    "dhp/data/formats.py": 2,
    "dhp/data/loader.py": 2,
    "dhp/data/packing.py": 3,
    "dhp/data/preflight.py": 3,
    "dhp/data/processing.py": 2,
    "dhp/data/ray_engine.py": 6,
    "dhp/data/remote.py": 1,
    "dhp/data/tabular.py": 3,
    "dhp/data/video.py": 6,
    "dhp/metrics/loggers.py": 7,
    "dhp/metrics/report.py": 2,
    "dhp/metrics/writer.py": 2,
    "dhp/parallel/optim.py": 1,
    "dhp/plan/calibrate.py": 2,
    "dhp/plan/reserve.py": 3,
    "dhp/plan/search.py": 1,
    "dhp/plan/trainable.py": 5,
    "dhp/runtime/loop/train.py": 21,
}


def _has_reason(lines: list[str], lineno: int) -> bool:
    """A comment on the import's line, or above it, past the imports and blank lines of its group."""
    if "#" in lines[lineno - 1]:
        return True
    i = lineno - 2
    while i >= 0:
        text = lines[i].strip()
        if text.startswith("#"):
            return True
        if not (
            text == "" or text.startswith(("import ", "from ")) or text.endswith((",", "(")) or text == ")"
        ):
            return False
        i -= 1
    return False


def uncommented_function_imports(path: Path) -> list[int]:
    """Line numbers of the imports inside functions of ``path`` that give no reason."""
    src = path.read_text()
    lines = src.splitlines()
    found = set()
    for fn in ast.walk(ast.parse(src)):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom) and not _has_reason(lines, node.lineno):
                    found.add(node.lineno)
    return sorted(found)


def test_imports_inside_functions_say_why() -> None:
    over = []
    for path in sorted((ROOT / "dhp").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in WHOLE_FILE_REASONS:
            continue
        lines = uncommented_function_imports(path)
        if len(lines) > UNREVIEWED.get(rel, 0):
            over.append(f"{rel}: lines {lines} (allowed without a reason: {UNREVIEWED.get(rel, 0)})")
    assert not over, (
        "imports inside functions without a comment saying why; move them to the top of the module, "
        "or write the reason (heavy/optional dependency, ...) beside them:\n" + "\n".join(over)
    )


def test_the_check_sees_a_bare_import_and_accepts_a_reason(tmp_path: Path) -> None:
    bare = tmp_path / "bare.py"
    bare.write_text("def f():\n    x = 1\n    import json\n\n    return json, x\n")
    assert uncommented_function_imports(bare) == [3]
    why = tmp_path / "why.py"
    why.write_text(
        "def f():\n    x = 1\n    # pyarrow is heavy: only for parquet\n    import pyarrow\n\n"
        "    from os import path\n    return pyarrow, path, x\n"
        "def g():\n    import ray  # Ray only in the driver\n    return ray\n"
    )
    assert uncommented_function_imports(why) == []
