"""Reading a rank's faulthandler dump (dhp.runtime.actors.stacks): the worker method its thread is inside and
that thread's innermost frame, from a real dump of this process while a thread waits inside one."""

from __future__ import annotations

import faulthandler
import tempfile
import threading

import pytest

from dhp.runtime.actors.stacks import _parse, _worker_methods, stuck_lines

pytestmark = pytest.mark.unit


class _Worker:
    def finalize_grads(self, inside: threading.Event, release: threading.Event) -> None:
        inside.set()
        release.wait()

    def idle(self) -> None: ...


def _dump() -> str:
    with tempfile.TemporaryFile() as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read().decode()


def test_a_thread_inside_a_worker_method_is_named_with_its_innermost_frame() -> None:
    inside, release = threading.Event(), threading.Event()
    t = threading.Thread(target=_Worker().finalize_grads, args=(inside, release))
    t.start()
    try:
        inside.wait(10)
        text = _dump()
    finally:
        release.set()
        t.join()
    st = _parse("llm", 1, 42, text, _worker_methods(_Worker))
    assert st.method == "finalize_grads" and st.where.endswith(" in wait"), st
    assert stuck_lines([st]) == [
        f"module 'llm' rank 1 (pid 42): in finalize_grads (the gradient sync), at {st.where}"
    ]


def test_a_rank_with_no_call_running_is_idle_and_one_without_a_dump_says_why() -> None:
    idle = _parse("vision", 0, 7, _dump(), _worker_methods(_Worker))
    assert idle.method is None and idle.title == "module 'vision' rank 0 (pid 7): idle (no call running)"
    gone = _parse("vision", 1, 8, "(no stack: process 8 is gone)", {})
    assert gone.title == "module 'vision' rank 1 (pid 8): (no stack: process 8 is gone)"
    assert stuck_lines([idle, gone]) == []
