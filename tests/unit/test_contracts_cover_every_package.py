"""The import contracts (``[tool.importlinter]`` in pyproject.toml, checked by ``lint-imports``) place every
package and top-level module of dhp in a layer, and no layer rule is waived for validation. Pure and fast."""

from __future__ import annotations

import pkgutil
from pathlib import Path

import pytest
import tomllib

import dhp

pytestmark = pytest.mark.unit

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _contracts() -> dict[str, dict]:
    data = tomllib.loads(PYPROJECT.read_text())
    return {c["id"]: c for c in data["tool"]["importlinter"]["contracts"]}


def test_every_package_of_dhp_is_in_a_layer():
    layered = {name.strip() for layer in _contracts()["layers"]["layers"] for name in layer.split("|")}
    present = {f"dhp.{m.name}" for m in pkgutil.iter_modules(dhp.__path__) if m.name != "__main__"}
    assert present - layered == set(), f"not in the layers contract: {sorted(present - layered)}"
    assert layered - present == set(), f"layers name what does not exist: {sorted(layered - present)}"


def test_the_layers_and_cycles_contracts_waive_nothing():
    """A layer violation or a package cycle is fixed where it is, never listed as an exception."""
    contracts = _contracts()
    assert not contracts["layers"].get("ignore_imports")
    assert not [i for i in contracts["no-cycles"].get("ignore_imports", []) if "validation" in i]


def test_validation_sits_above_the_families_and_the_strategies():
    layers = [{n.strip() for n in layer.split("|")} for layer in _contracts()["layers"]["layers"]]
    at = {name: i for i, layer in enumerate(layers) for name in layer}  # 0 = the top
    assert at["dhp.plan"] < at["dhp.validation"] < at["dhp.models"] < at["dhp.parallel"] < at["dhp.config"]


def test_every_room_of_the_runtime_is_in_the_rooms_contract_and_nothing_lies_outside_one():
    """``dhp.runtime`` holds only its rooms (subpackages, each in the ``runtime-rooms`` layers)."""
    import dhp.runtime

    rooms = _contracts()["runtime-rooms"]
    assert rooms["containers"] == ["dhp.runtime"]
    layered = {name.strip() for layer in rooms["layers"] for name in layer.split("|")}
    found = {m.name: m.ispkg for m in pkgutil.iter_modules(dhp.runtime.__path__)}
    assert [n for n, pkg in found.items() if not pkg] == [], "a module outside the rooms of dhp.runtime"
    assert set(found) == layered, f"rooms {sorted(found)} vs the contract's {sorted(layered)}"
