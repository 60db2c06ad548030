"""The start-up timeline: phases in order, each from the previous mark, the process's own start first."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time

import pytest
from rich.console import Console

from dhp.runtime.launch import startup
from dhp.runtime.launch.startup import Startup, process_age_s


def test_phases_sum_to_the_wall_time_and_render(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("dhp.runtime.launch.startup._FIRST_RUN", True)
    age = process_age_s()
    assert age is not None and age > 0  # this process started before the test
    clock = Startup.from_process_start()
    t0 = time.perf_counter()
    time.sleep(0.05)
    clock.mark("Ray start")
    time.sleep(0.02)
    clock.mark("build")
    clock.add("step 1", 0.5)
    names = [p for p, _ in clock.phases]
    assert names == ["imports + config (this process)", "Ray start", "build", "step 1"]
    marked = sum(s for p, s in clock.phases[1:3])
    assert abs(marked - (time.perf_counter() - t0)) < 0.01  # no gap between consecutive marks
    assert clock.phases[1][1] >= 0.05
    clock.write(tmp_path / "startup.json")
    data = json.loads((tmp_path / "startup.json").read_text())
    assert [p["phase"] for p in data["phases"]] == names
    buf = io.StringIO()
    clock.render(Console(file=buf, width=100))
    assert "start-up:" in buf.getvalue() and "Ray start" in buf.getvalue()


def test_a_second_run_of_one_process_does_not_count_the_first(monkeypatch) -> None:
    monkeypatch.setattr("dhp.runtime.launch.startup._FIRST_RUN", True)
    assert Startup.from_process_start().phases  # the process's own start-up
    assert Startup.from_process_start().phases == []  # a sweep's next run: its phases only


# the driver's path to Ray's start, run in a fresh interpreter: it stops where Ray would start and
# says which heavy modules were loaded by then
_TO_RAY_START = """
import json, sys
import dhp.cli  # what `dhp train` loads first
import dhp.runtime.loop.train as tr
from dhp.validation import load_config
from dhp.errors import PlanError

seen = {}

def at_ray_start(*, cluster, plan, modules=()):
    seen.update({m: m in sys.modules for m in sys.argv[2:]})
    raise PlanError("stop at Ray's start")

tr.connect_ray_importing = at_ray_start
try:
    tr.train(load_config("tiny_vlm", [f"train.output_dir={sys.argv[1]}"]))
except PlanError:
    pass
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_the_driver_reaches_ray_start_without_transformers_model_code(tmp_path) -> None:
    """What ``connect_ray_importing`` overlaps with Ray's start must not already be loaded before it:
    transformers' model code and the worker module (each over a second of CPU on the 2-core box)."""
    heavy = ["transformers.modeling_utils", "dhp.runtime.loop.worker", "dhp.runtime.loop.driver"]
    seen = _fresh_interpreter(_TO_RAY_START, str(tmp_path), *heavy)
    assert seen == dict.fromkeys(heavy, False), seen


def test_connect_ray_importing_imports_while_ray_starts(tmp_path, monkeypatch) -> None:
    """The modules are imported by a thread while the connect call runs on the calling thread."""
    (tmp_path / "dhp_probe_slow_module.py").write_text("import time\ntime.sleep(0.2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    during = {}

    def connect(*, cluster, plan) -> bool:  # stands in for ray.init: waits, holding no GIL
        deadline = time.monotonic() + 30
        while "dhp_probe_slow_module" not in sys.modules and time.monotonic() < deadline:
            time.sleep(0.01)
        during["imported"] = "dhp_probe_slow_module" in sys.modules
        during["main thread"] = threading.current_thread() is threading.main_thread()
        return True

    monkeypatch.setattr(startup, "connect_ray", connect)
    owns = startup.connect_ray_importing(cluster=None, plan=None, modules=["dhp_probe_slow_module"])
    assert owns is True
    assert during == {"imported": True, "main thread": True}
    assert not [t for t in threading.enumerate() if t.name == "dhp-imports"]  # joined


def test_a_module_that_fails_to_import_in_the_thread_is_left_to_the_caller(monkeypatch) -> None:
    monkeypatch.setattr(startup, "connect_ray", lambda *, cluster, plan: False)
    assert startup.connect_ray_importing(cluster=None, plan=None, modules=["dhp_no_such_module"]) is False


_DRIVER_SIDE = """
import json, sys
import dhp.runtime.loop.driver, dhp.runtime.loop.checkpointing, dhp.data, dhp.runtime.loop.progress
from dhp.validation import load_config
from dhp.models import get_family
from dhp.runtime.loop.driver_start import _hf_config
seen = {}
for recipe in sys.argv[1:]:
    cfg = load_config(recipe, [])
    family = get_family(cfg.model.family)
    hf = _hf_config(family, cfg.model)
    family.handoffs_for(hf), family.modules_for(hf)
    seen[recipe] = "transformers.modeling_utils" in sys.modules
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_the_driver_uses_every_family_without_loading_transformers_model_code() -> None:
    """The driver reads a family's module names, transformers config and hand-offs; only a rank
    builds modules. Loading model code there would cost the driver ~2.3 CPU-s of start-up, taken
    from the rank processes starting beside it."""
    recipes = ["tiny_vlm", "tiny_qwen3_vl", "tiny_qwen3_vl_moe", "tiny_qwen3_5", "tiny_qwen3_5_moe"]
    seen = _fresh_interpreter(_DRIVER_SIDE, *recipes)
    assert seen == dict.fromkeys(recipes, False), seen


def _fresh_interpreter(code: str, *args: str) -> dict:
    """Run ``code`` in a new Python (nothing imported yet) and parse the JSON of its last line."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_actors_line_says_how_the_ranks_began_and_why_a_node_could_not_fork() -> None:
    assert (
        startup.actors_phase(["forked"] * 8)
        == "actors start (8 ranks forked from the pre-imported fork server)"
    )
    assert startup.actors_phase(["fresh"] * 2) == "actors start (a process per rank, its imports)"
    why = "on node 10.0.0.2 (3fa2c1d0): its Python is /opt/py/bin/python, the driver's is /usr/bin/python"
    line = startup.actors_phase(["forked"] * 4 + [f"fresh: {why}"] * 4)
    assert line == f"actors start (4 of 8 ranks forked; the others imported everything: {why})"
