"""The start-up timeline: phases in order, each from the previous mark, the process's own start first."""

from __future__ import annotations

import io
import json
import time

from rich.console import Console

from dhp.runtime.startup import Startup, process_age_s


def test_phases_sum_to_the_wall_time_and_render(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("dhp.runtime.startup._FIRST_RUN", True)
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
    monkeypatch.setattr("dhp.runtime.startup._FIRST_RUN", True)
    assert Startup.from_process_start().phases  # the process's own start-up
    assert Startup.from_process_start().phases == []  # a sweep's next run: its phases only
