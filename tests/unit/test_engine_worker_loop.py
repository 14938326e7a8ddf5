"""The worker's stepping loop: a step that raises, or an idle engine found broken, ends the process (one line on stderr, exit
status 70), so Ray sees the worker dead and its streams move; it never leaves a worker that
beats but no longer steps."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from cluster.worker.engine_worker import EXIT_STEP_FAILED, EngineWorker, StepLock

pytestmark = pytest.mark.unit


class Exited(Exception):
    pass


def failing_worker(error: BaseException) -> tuple[EngineWorker, list]:
    worker = object.__new__(EngineWorker)
    steps, exits = [], []

    def step():
        steps.append(1)
        if len(steps) == 2:
            raise error
        return ["out"]

    def exit_(status):
        exits.append(status)
        raise Exited

    worker.name, worker._stop, worker._lock = "decode-3", threading.Event(), StepLock()
    worker.engine = SimpleNamespace(step=step, check_health=lambda: None)
    worker._has_work = lambda: True
    worker.outputs = []
    worker._on_outputs = worker.outputs.append
    worker._exit = exit_
    worker.marks = []  # what the loop told the machine's serving mark, step by step
    worker._serving = SimpleNamespace(mark=worker.marks.append)
    worker._compute_with_short_slices = lambda: 0  # the test's thread keeps its slice
    return worker, exits


def test_a_step_that_raises_ends_the_process_with_one_line(capsys):
    worker, exits = failing_worker(RuntimeError("tensor-parallel rank decode-3-tp1 failed while running a step: "
                                                "the actor died unexpectedly\nsecond line"))
    with pytest.raises(Exited):
        worker._run()
    assert exits == [EXIT_STEP_FAILED] == [70]
    assert worker.outputs == [["out"]]  # the step before it was delivered
    assert worker.marks == [True, True]  # serving at each step (the machine's KV fault-ins pause meanwhile)
    assert capsys.readouterr().err == (
        "[tandem] worker decode-3: its engine failed (tensor-parallel rank decode-3-tp1 failed while running a step: "
        "the actor died unexpectedly); the worker exits to be started again\n")


def test_an_idle_worker_whose_engine_is_broken_exits():
    worker, exits = failing_worker(RuntimeError("never"))
    worker._has_work = lambda: False

    def broken():
        raise RuntimeError("decode-3-tp1 died: the actor died unexpectedly")

    worker.engine.check_health = broken
    with pytest.raises(Exited):
        worker._run()
    assert exits == [EXIT_STEP_FAILED]
    assert worker.marks == [False]  # idle: not serving


def test_a_stop_ends_the_loop_without_exiting():
    worker, exits = failing_worker(RuntimeError("never"))
    worker._has_work = lambda: False
    worker._stop.set()
    worker._run()
    assert exits == []
