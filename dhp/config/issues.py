"""The issue collector shared by the validation passes."""

from __future__ import annotations

from typing import Any

from dhp.errors import ConfigIssue


class Issues:
    """Accumulates issues; ``check(cond, ...)`` records one when ``cond`` is false."""

    def __init__(self) -> None:
        self.items: list[ConfigIssue] = []

    def add(self, path: str, value: Any, rule: str, fix: str) -> None:
        self.items.append(ConfigIssue(path=path, value=value, rule=rule, fix=fix))

    def check(self, ok: bool, path: str, value: Any, rule: str, fix: str) -> bool:
        if not ok:
            self.add(path, value, rule, fix)
        return ok

    def positive(self, node: Any, prefix: str, keys: list[str]) -> None:
        for key in keys:
            value = node[key]
            self.check(
                isinstance(value, (int, float)) and value > 0,
                f"{prefix}.{key}",
                value,
                "must be > 0",
                "set a positive value",
            )

    def one_of(self, value: Any, path: str, allowed: tuple[str, ...]) -> bool:
        return self.check(
            value in allowed,
            path,
            value,
            f"unknown value; allowed: {', '.join(allowed)}",
            f"use one of {allowed}",
        )
