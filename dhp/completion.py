"""Shell completion of the ``key=value`` arguments of ``dhp plan|train|verify|data check``.

``conf=<TAB>`` offers the recipes in ``recipes/`` (and YAML files under the typed directory),
``smoke=<TAB>`` true/false, and an empty word offers ``conf=`` and ``smoke=``. Installed with
``dhp --install-completion`` (typer's; bash, zsh, fish, powershell).
"""

from __future__ import annotations

from pathlib import Path

import typer

#: recipes/ beside the package (as dhp.config.loader.RECIPES_DIR, without importing Hydra to complete)
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"


def complete_word(ctx: typer.Context, incomplete: str) -> list[str]:
    """typer's completion hook: the words parsed so far are the command's ``words`` argument."""
    return complete_args([*(ctx.params.get("words") or ()), *ctx.args], incomplete)


def complete_args(args: list[str], incomplete: str) -> list[str]:
    """The completions of the word ``incomplete`` after the words ``args``.

    zsh and fish hand over ``conf=tin`` whole; bash splits it at ``=`` (``args`` end with ``conf``,
    ``=``; ``incomplete`` is ``tin``), and then the values alone are offered, as bash replaces
    only the part after ``=``.
    """
    if len(args) >= 2 and args[-1] == "=":
        return [c.partition("=")[2] for c in _values(args[-2], incomplete)]
    key, eq, value = incomplete.partition("=")
    if not eq:
        return [w for w in ("conf=", "smoke=") if w.startswith(incomplete)]
    return _values(key, value)


def _values(key: str, value: str) -> list[str]:
    if key == "smoke":
        return [f"smoke={v}" for v in ("true", "false") if v.startswith(value)]
    if key != "conf":
        return []
    if "/" in value or value.startswith("."):  # a path: YAML files and folders under it
        folder, _, stem = value.rpartition("/")
        base = Path(folder or ".")
        if not base.is_dir():
            return []
        out = []
        for p in sorted(base.iterdir()):
            if p.name.startswith(stem) and (p.is_dir() or p.suffix in (".yaml", ".yml")):
                out.append(f"conf={folder + '/' if folder else ''}{p.name}{'/' if p.is_dir() else ''}")
        return out
    return [f"conf={p.stem}" for p in sorted(RECIPES_DIR.glob("*.yaml")) if p.stem.startswith(value)]
