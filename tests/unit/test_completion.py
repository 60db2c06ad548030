"""`conf=<TAB>` completes recipe names, through typer's own completion protocol (bash and zsh)."""

from __future__ import annotations

import os
import subprocess
import sys

from dhp.completion import complete_args


def _complete(shell: str, words: str, cword: int | None = None) -> list[str]:
    env = dict(os.environ, _DHP_COMPLETE=f"complete_{shell}")
    if shell == "bash":  # bash splits conf=tin at '=' (COMP_WORDBREAKS)
        env |= {"COMP_WORDS": words, "COMP_CWORD": str(cword)}
    else:
        env["_TYPER_COMPLETE_ARGS"] = words
    code = "import sys; sys.argv[0] = 'dhp'; from dhp.cli import app; app(prog_name='dhp')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    return out.stdout.split()


def test_bash_completes_the_recipe_after_the_equals_sign() -> None:
    assert _complete("bash", "dhp train conf = tiny_vlm_l", 4) == ["tiny_vlm_lora"]
    assert "tiny_vlm" in _complete("bash", "dhp plan conf = ", 4)


def test_zsh_completes_the_whole_word() -> None:
    assert "conf=tiny_vlm_lora" in " ".join(_complete("zsh", "dhp verify conf=tiny_vlm_l"))


def test_paths_smoke_and_keys(tmp_path) -> None:
    (tmp_path / "mine.yaml").write_text("name: x\n")
    (tmp_path / "notes.txt").write_text("")
    assert complete_args([], f"conf={tmp_path}/m") == [f"conf={tmp_path}/mine.yaml"]
    assert complete_args([], f"conf={tmp_path}/n") == []  # not a YAML file
    assert complete_args([], "smoke=t") == ["smoke=true"]
    assert complete_args([], "co") == ["conf="]
