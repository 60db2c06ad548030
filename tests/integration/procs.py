"""Process-tree helpers shared by the integration tests that kill, interrupt or tear down runs
(imported as a sibling module, like ``plans``). Linux /proc only."""

from __future__ import annotations

from pathlib import Path


def descendants(root: int) -> list[int]:
    """Pids below ``root`` in the process tree, parents before children (a driver's raylet and
    actors are its descendants)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
