"""Which modules share GPUs: the forms of the ``placement`` key, parsed in one place (pure).

- ``collocated``: every module on the same GPUs (one sharing set): rank r of each module sits on
  the same GPU, each taking ``1 / modules`` of it;
- ``disaggregated``: every module on GPUs of its own (one set per module, in declaration order);
- a partition, e.g. ``audio+vision/llm``: GPU-sharing sets separated by ``/``, the modules of one set
  joined by ``+``. The modules of a set share its GPUs as collocated modules do (equal GPU counts);
  the sets take disjoint GPUs, in the order written. Every module is in exactly one set.

``/`` separates the sets, not ``,``: on the command line ``placement=a+b,c`` is Hydra's sweep syntax
(two values, refused by ``dhp train``), while ``placement=a+b/c`` is one plain string to Hydra, the
shell and YAML alike. Everything that asks "do these modules share GPUs" (GPU assignment, memory per
GPU, the step schedule, the hand-off transport, the ``--auto`` search) asks :func:`shares_gpus` or
:func:`sharing_sets`, never the placement string.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dhp.errors import PlanError

COLLOCATED, DISAGGREGATED = "collocated", "disaggregated"
SET_SEPARATOR, SHARE_SEPARATOR = "/", "+"

#: GPU-sharing sets of module names, in the order they take GPUs
Sets = tuple[tuple[str, ...], ...]


def parse_placement(placement: str, modules: Sequence[str]) -> tuple[Sets, str | None]:
    """``(sets, problem)``: the GPU-sharing sets ``placement`` means for ``modules`` (declaration
    order), and a sentence saying what is wrong with it and how to fix it (None when it is valid)."""
    names = [str(m) for m in modules]
    text = str(placement)
    if text == COLLOCATED:
        return ((tuple(names),) if names else ()), None
    if text == DISAGGREGATED:
        return tuple((n,) for n in names), None
    example = f"{SET_SEPARATOR}".join(names) if names else "a+b/c"
    if "," in text:
        fixed = text.replace(",", SET_SEPARATOR)
        return (), (
            f"sets of a partition are separated by '{SET_SEPARATOR}', not ',' (on the command line ',' "
            f"is Hydra's sweep syntax). Fix: placement={fixed}"
        )
    sets = tuple(tuple(m.strip() for m in part.split(SHARE_SEPARATOR)) for part in text.split(SET_SEPARATOR))
    if len(sets) < 2 and SHARE_SEPARATOR not in text and text not in names:
        return (), (
            f"must be {COLLOCATED}, {DISAGGREGATED} or a partition of the modules {names} into "
            f"GPU-sharing sets (modules of a set joined by '{SHARE_SEPARATOR}', sets separated by "
            f"'{SET_SEPARATOR}'). Fix: e.g. placement={example}"
        )
    seen: dict[str, int] = {}
    for i, group in enumerate(sets):
        if any(not m for m in group):
            return (), f"has an empty module name in set {i + 1} ('{SHARE_SEPARATOR.join(group)}'). Fix: " \
                f"name each module once, e.g. placement={example}"  # fmt: skip
        for m in group:
            if m not in names:
                return (), f"names '{m}', which is not a module of this run (modules: {names}). Fix: " \
                    f"use only these names, e.g. placement={example}"  # fmt: skip
            if m in seen:
                return (), f"puts module '{m}' in two sets (sets {seen[m] + 1} and {i + 1}); a module " \
                    "runs on one set of GPUs. Fix: name it in one set only"  # fmt: skip
            seen[m] = i
    missing = [n for n in names if n not in seen]
    if missing:
        return (), (
            f"leaves out module(s) {missing}; every module needs a set of GPUs. Fix: add them, e.g. "
            f"placement={text}{SET_SEPARATOR}{SHARE_SEPARATOR.join(missing)}"
        )
    return sets, None


def sharing_sets(placement: str, modules: Sequence[str]) -> Sets:
    """The GPU-sharing sets of ``placement`` over ``modules`` (the run's, in declaration order);
    PlanError naming the ``placement`` key and the fix when it is not valid for them."""
    sets, problem = parse_placement(placement, modules)
    if problem is not None:
        raise PlanError(f"placement={placement}: {problem}")
    return sets


def sets_among(placement: str, names: Sequence[str]) -> Sets:
    """The sharing sets of ``placement`` restricted to ``names`` (a module graph's modules, a subset of
    the run's): a named form over ``names``; a partition as written (it may name other modules of
    the run), which must hold every one of ``names``. PlanError otherwise."""
    if str(placement) in (COLLOCATED, DISAGGREGATED):
        return sharing_sets(placement, names)
    written = [m.strip() for part in str(placement).split(SET_SEPARATOR) for m in part.split(SHARE_SEPARATOR)]
    sets = within(sharing_sets(placement, list(dict.fromkeys(written))), names)
    missing = [n for n in names if not any(n in group for group in sets)]
    if missing:
        raise PlanError(f"placement={placement}: leaves out module(s) {missing}. Fix: add them to a set")
    return sets


def within(sets: Sets, names: Iterable[str]) -> Sets:
    """``sets`` restricted to ``names`` (e.g. a module graph's modules), empty sets dropped."""
    keep = set(names)
    return tuple(s for s in (tuple(m for m in group if m in keep) for group in sets) if s)


def set_of(sets: Sets, module: str) -> tuple[str, ...]:
    """The sharing set that holds ``module``."""
    for group in sets:
        if module in group:
            return group
    raise PlanError(f"module '{module}' is in no GPU-sharing set of {list(sets)}")


def shares_gpus(sets: Sets, a: str, b: str) -> bool:
    """Whether modules ``a`` and ``b`` run on the same GPUs (the same sharing set)."""
    return b in set_of(sets, a)


def placement_name(sets: Sets, modules: Sequence[str]) -> str:
    """The ``placement`` value of ``sets`` over ``modules``: ``collocated`` for one set,
    ``disaggregated`` for one set per module in declaration order, else the partition form."""
    names = tuple(str(m) for m in modules)
    if len(sets) <= 1:
        return COLLOCATED
    if sets == tuple((n,) for n in names):
        return DISAGGREGATED
    return SET_SEPARATOR.join(SHARE_SEPARATOR.join(group) for group in sets)


def partitions(modules: Sequence[str]) -> list[Sets]:
    """Every partition of ``modules`` into sharing sets, each set and the sets in declaration order
    (the sets' order only decides which GPUs each takes, not the plan's time or memory)."""
    names = [str(m) for m in modules]
    if not names:
        return [()]
    out: list[Sets] = []
    for rest in partitions(names[1:]):
        out.append(((names[0],), *rest))
        for i in range(len(rest)):
            out.append((*rest[:i], (names[0], *rest[i]), *rest[i + 1 :]))
    canonical = [tuple(sorted(p, key=lambda g: names.index(g[0]))) for p in out]
    return sorted(canonical, key=lambda p: (len(p), [[names.index(m) for m in g] for g in p]))
