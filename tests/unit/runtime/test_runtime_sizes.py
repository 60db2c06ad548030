"""The runtime stays in small pieces: no function in dhp/runtime over 60 lines, no class over 250
(``end_lineno - lineno + 1`` of the AST node, decorators not counted; nested functions and classes
count on their own too). A failure names every offender with its file, line and size."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dhp

pytestmark = pytest.mark.unit

MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250
RUNTIME = Path(dhp.__file__).parent / "runtime"


def oversize(tree: ast.AST, *, where: str = "") -> list[str]:
    """``where:line kind name (n lines)`` for each function over MAX_FUNCTION_LINES and each class
    over MAX_CLASS_LINES in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kind, limit = "function", MAX_FUNCTION_LINES
        elif isinstance(node, ast.ClassDef):
            kind, limit = "class", MAX_CLASS_LINES
        else:
            continue
        n = node.end_lineno - node.lineno + 1
        if n > limit:
            out.append(f"{where}:{node.lineno} {kind} {node.name} ({n} lines > {limit})")
    return out


def test_no_function_over_60_lines_and_no_class_over_250_in_the_runtime():
    files = sorted(RUNTIME.rglob("*.py"))
    assert len(files) > 30  # the walk sees the rooms' modules, not an empty folder
    found = []
    for path in files:
        found += oversize(ast.parse(path.read_text()), where=str(path.relative_to(RUNTIME.parent.parent)))
    assert not found, "split these (docs/ARCHITECTURE.md, the runtime's rooms):\n" + "\n".join(found)


def test_the_size_check_sees_functions_methods_and_classes():
    """The walk is not blind: a 61-line method inside a 251-line class is two offenders, 60 and 250 none."""
    body = "\n".join(f"        x{i} = {i}" for i in range(59))
    method = f"    def big(self):\n{body}\n        return 0\n"  # 61 lines
    filler = "\n".join(f"    a{i} = {i}" for i in range(251 - 1 - 61))
    code = f"class Big:\n{method}{filler}\n"
    assert oversize(ast.parse(code), where="m.py") == [
        "m.py:1 class Big (251 lines > 250)",
        "m.py:2 function big (61 lines > 60)",
    ]
    ok = "def fits():\n" + "\n".join(f"    y{i} = {i}" for i in range(59)) + "\n"  # 60 lines
    assert oversize(ast.parse(ok)) == []
