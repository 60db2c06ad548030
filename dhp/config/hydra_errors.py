"""Turn Hydra/OmegaConf composition failures into a ConfigError that names the key path.

Hydra raises a handful of types (override parse errors, unknown keys in struct mode, missing group
options, type mismatches) wrapped in one another. Users must never see those tracebacks: each is
mapped to one :class:`~dhp.errors.ConfigIssue` with the path, the value, the rule and a fix.
"""

from __future__ import annotations

import re

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf.errors import OmegaConfBaseException

from dhp.config.constants import MODULE_NAMES
from dhp.config.keys import did_you_mean
from dhp.errors import ConfigError, ConfigIssue

_OVERRIDE_KEY = re.compile(r"Could not (?:override|append to config\.) '([^']+)'")
_MISSING_OPTION = re.compile(r"Could not find '([^']+)'")
_AVAILABLE = re.compile(r"Available options in '[^']+':\n((?:\t.+\n?)+)")


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _omegaconf_issue(err: OmegaConfBaseException, overrides: list[str]) -> ConfigIssue | None:
    full_key = getattr(err, "full_key", None)
    if not full_key:
        return None
    full_key = _qualify(str(full_key), overrides)
    msg = str(err).splitlines()[0]
    value = getattr(err, "value", None)
    if value is None:
        value = _override_value(full_key, overrides)
    head, _, rest = str(full_key).partition(".")
    if head == "modules" and rest and rest.split(".")[0] not in _module_names():
        rule = f"unknown module {rest.split('.')[0]!r}; known modules: {', '.join(_module_names())}"
        fix = "use one of the known module names (modules.vision, modules.llm)"
    elif "not in" in msg or "Key '" in msg:
        rule = f"unknown key ({msg}){did_you_mean(str(full_key))}"
        fix = "check the spelling against dhp/config/schema.py; unknown keys are errors in struct mode"
    else:
        rule = msg
        fix = "give a value of the type declared in dhp/config/schema.py"
    return ConfigIssue(path=str(full_key), value=value, rule=rule, fix=fix)


def _module_names() -> tuple[str, ...]:
    return tuple(MODULE_NAMES)


def _qualify(key: str, overrides: list[str]) -> str:
    """OmegaConf names a new dict entry by its last key only; recover the full path from the override."""
    for ov in overrides:
        lhs = ov.lstrip("+~").partition("=")[0]
        parts = lhs.split(".")
        if key in parts and "." not in key:
            return ".".join(parts[: parts.index(key) + 1])
    return key


def _override_value(key: str, overrides: list[str]) -> object:
    for ov in overrides:
        lhs, _, rhs = ov.lstrip("+~").partition("=")
        if lhs == key:
            return rhs
    return None


def _missing_option_issue(msg: str, conf: str) -> ConfigIssue:
    match = _MISSING_OPTION.search(msg)
    missing = match.group(1) if match else "?"
    group, _, option = missing.rpartition("/")
    avail = _AVAILABLE.search(msg)
    options = ", ".join(x.strip() for x in avail.group(1).splitlines()) if avail else ""
    if not group:
        return ConfigIssue(
            path="defaults",
            value=missing,
            rule=f"config '{missing}' named in the defaults of {conf} does not exist",
            fix="name an existing recipe or group option",
        )
    return ConfigIssue(
        path=group.strip("/").replace("/", "."),
        value=option,
        rule=f"no option '{option}' in config group '{group}'",
        fix=f"choose one of: {options}" if options else f"add conf/{group}/{option}.yaml",
    )


_SPECIAL = re.compile(r"[\[\]{}()*?,:= ]")


def _parse_issue(err: OverrideParseException, overrides: list[str]) -> ConfigIssue:
    """The override Hydra's grammar refused; a value holding brackets or globs gets the quoting fix."""

    parser = OverridesParser.create()
    bad, reason = "", str(err).splitlines()[0]
    for override in overrides:  # Hydra names the grammar's complaint, not the override: find it
        try:
            parser.parse_overrides([override])
        except OverrideParseException as e:
            bad, reason = override, str(e).splitlines()[0]
            break
    key, eq, value = bad.partition("=")
    if not eq:
        fix = "write overrides as key=value, e.g. modules.vision.parallel.sp=4"
    elif value.startswith("[") or value.startswith("{"):
        body = value[1:-1] if value[-1:] in "]}" else value[1:]
        inner = [v.strip() for v in body.split(",") if v.strip()]
        quoted = ",".join(f"'{v.strip(chr(39) + chr(34))}'" for v in inner) or "'...'"
        fix = (
            "quote each list element that holds brackets, globs or spaces, and the whole override "
            f'for the shell, e.g. "{key}=[{quoted}]"'
        )
    elif _SPECIAL.search(value):
        fix = f"quote the value for Hydra, and the override for the shell: \"{key}='{value}'\""
    else:
        fix = "write overrides as key=value, e.g. modules.vision.parallel.sp=4"
    return ConfigIssue(
        path=key or "<override>", value=bad or value, rule=f"not a valid Hydra override ({reason})", fix=fix
    )


def to_config_error(exc: BaseException, *, conf: str, overrides: list[str]) -> ConfigError:
    """Map any composition failure to a ConfigError (keeps an existing ConfigError as is)."""
    if isinstance(exc, ConfigError):
        return exc
    chain = _chain(exc)
    for err in chain:
        if isinstance(err, OverrideParseException):
            return ConfigError([_parse_issue(err, overrides)])
        if isinstance(err, MissingConfigException):
            return ConfigError([_missing_option_issue(str(err), conf)])
    for err in chain:
        if isinstance(err, OmegaConfBaseException):
            issue = _omegaconf_issue(err, overrides)
            if issue is not None:
                return ConfigError([issue])
    msg = str(exc)
    match = _OVERRIDE_KEY.search(msg)
    if match:
        key = match.group(1)
        return ConfigError(
            [
                ConfigIssue(
                    path=key,
                    value=_override_value(key, overrides),
                    rule="this key is not in the config (struct mode)",
                    fix="check the spelling against dhp/config/schema.py; "
                    f"to add a new entry use +{key}=VALUE",
                )
            ]
        )
    first = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
    return ConfigError(
        [
            ConfigIssue(
                path="<compose>",
                value=conf,
                rule=f"Hydra could not compose the config: {first}",
                fix="check the recipe's defaults list and the overrides",
            )
        ]
    )
