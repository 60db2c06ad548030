"""The generic layers name no model family: everything family-specific lives in dhp/models/<family>/.

The same check as ``grep -rniE 'qwen' dhp/plan dhp/parallel dhp/runtime dhp/checkpoint dhp/config
dhp/data`` (which must print nothing), over every file under those folders, plus the torch-free
registry finding each family by its folder.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
GENERIC = ("dhp/plan", "dhp/parallel", "dhp/runtime", "dhp/checkpoint", "dhp/config", "dhp/data")


def test_generic_layers_name_no_family() -> None:
    hits = []
    for folder in GENERIC:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    if re.search("qwen", line, re.IGNORECASE):
                        hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert hits == [], "generic layers name a model family:\n" + "\n".join(hits)


@pytest.mark.skipif(shutil.which("grep") is None, reason="no grep on this machine")
def test_the_grep_itself_prints_nothing() -> None:
    out = subprocess.run(["grep", "-rniIE", "qwen", *GENERIC], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout == "", out.stdout


def test_families_are_found_by_folder() -> None:
    from dhp.models.registry import family_names

    folders = sorted(p.parent.name for p in (ROOT / "dhp/models").glob("*/family.py"))
    assert family_names() == folders and "qwen2_5_vl" in folders
