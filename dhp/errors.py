"""User-facing error types. The CLI prints these as a short message, never a traceback."""

from __future__ import annotations

from dataclasses import dataclass


class DhpError(Exception):
    """Base of every error a user can fix: the message says what, where and how."""


@dataclass(frozen=True)
class ConfigIssue:
    """One validation problem: the key path, the offending value, the rule, and a fix."""

    path: str
    value: object
    rule: str
    fix: str

    def __str__(self) -> str:
        if not self.fix:  # a message written whole (ConfigError(str)): it carries its own fix
            return self.rule
        return f"{self.path} = {self.value!r}: {self.rule}. Fix: {self.fix}"


class ConfigError(DhpError):
    """A config failed validation. Holds every issue found in one pass."""

    def __init__(self, issues: list[ConfigIssue] | str) -> None:
        if isinstance(issues, str):
            issues = [ConfigIssue(path="<config>", value=None, rule=issues, fix="")]
        self.issues = list(issues)
        lines = [f"{len(self.issues)} config error(s):"] + [f"  - {i}" for i in self.issues]
        super().__init__("\n".join(lines))


class PlanError(DhpError):
    """A valid config that cannot be planned or placed (cluster too small, reservation timed out)."""


class DataError(DhpError):
    """A bad sample or dataset; the message names the file, the line/index and the reason."""


class CheckpointError(DhpError):
    """A checkpoint that cannot be written, found or loaded under this plan."""


class RuntimeFailure(DhpError):
    """A failure during training: dead actor (module, rank), hang, non-finite loss or grad norm."""
