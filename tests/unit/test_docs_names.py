"""The project docs name only what exists: every ```dhp.x.y``` name imports and resolves, and every
repo path (brace groups expanded, ``*`` globbed, ``<placeholder>`` segments skipped) is there.

A rename or a removed module that leaves a doc behind fails here with the doc and the name.
"""

from __future__ import annotations

import glob
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"])
DOTTED = re.compile(r"`(dhp(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
PATH = re.compile(r"`((?:dhp|tests|scripts|conf|recipes|docs)/[^` ]*)`")


def _resolves(dotted: str) -> bool:
    """Import the longest module prefix of ``dotted``, then walk the rest as attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _expand(pattern: str) -> list[str]:
    """``a/{b,c}.py`` -> ``[a/b.py, a/c.py]`` (one level of braces per group, applied repeatedly)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [
        p for alt in m.group(1).split(",") for p in _expand(pattern[: m.start()] + alt + pattern[m.end() :])
    ]


def _exists(pattern: str) -> bool:
    if "<" in pattern:  # a placeholder such as dhp/models/<family>/
        return True
    return all(glob.glob(str(ROOT / p)) for p in _expand(pattern))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_name_only_what_exists(doc: Path) -> None:
    text = doc.read_text()
    names = sorted(set(DOTTED.findall(text)))
    paths = sorted(set(PATH.findall(text)))
    missing = [n for n in names if not _resolves(n)] + [p for p in paths if not _exists(p)]
    assert not missing, f"{doc.relative_to(ROOT)} names what does not exist: {missing}"


def test_the_checks_can_fail() -> None:
    assert not _resolves("dhp.plan.no_such_name")
    assert not _exists("dhp/{plan,no_such_layer}")
    assert _exists("dhp/{plan,parallel}/__init__.py")
