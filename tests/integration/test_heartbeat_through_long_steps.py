"""A worker's heartbeat through a step longer than its lifetime (real Redis, the worker's real lock
and reporter): a long prompt chunk on a starved CPU keeps its worker in the routers' view, with
the report taken before the step; a step past ``STEP_BEAT_LIMIT_S`` (hung) lets the worker lapse."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.registry.keys import Keys
from cluster.registry.load import WorkerLoad, read_loads
from cluster.registry.reporter import WorkerReporter
from cluster.worker import engine_worker
from cluster.worker.engine_worker import EngineWorker, StepLock
from conftest import wait_for

pytestmark = pytest.mark.integration

CLUSTER = "heartbeat"
TTL_S = 0.6


def stand_in_worker(free_blocks: list[int]) -> EngineWorker:
    """An EngineWorker's lock and report snapshot, with a load that says how many snapshots were taken."""
    worker = object.__new__(EngineWorker)
    worker._lock = StepLock()

    def snapshot_held():
        free_blocks[0] += 1
        return [], WorkerLoad("prefill-0", "prefill", 0, 1, 0, 1024, 0, free_blocks[0], 64, 16, 2048, 4)

    worker._snapshot_held = snapshot_held
    return worker


def hold_engine(worker: EngineWorker, seconds: float) -> threading.Thread:
    """The stepping loop's turn held for ``seconds``, as one long step holds it."""
    started = threading.Event()

    def step():
        with worker._lock.step_turn():
            started.set()
            time.sleep(seconds)

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    started.wait()
    return thread


def test_a_step_longer_than_the_heartbeat_keeps_the_worker_seen_with_its_last_report(redis_server, redis_client,
                                                                                      monkeypatch):
    monkeypatch.setattr(engine_worker, "REPORT_WAIT_S", 0.1)
    taken = [0]
    worker = stand_in_worker(taken)
    reporter = WorkerReporter(redis_server.url, CLUSTER, "prefill-0", worker._report_snapshot, interval_s=0.05,
                              heartbeat_ttl_s=TTL_S)
    try:
        before = wait_for(lambda: read_loads(redis_client, CLUSTER, ["prefill-0"]).get("prefill-0"),
                          what="the first report")
        step = hold_engine(worker, 5 * TTL_S)
        time.sleep(0.15)  # a report that was being taken when the step began has been published
        during = read_loads(redis_client, CLUSTER, ["prefill-0"])["prefill-0"]
        seen = []
        while step.is_alive():
            seen.append(read_loads(redis_client, CLUSTER, ["prefill-0"]).get("prefill-0"))
            time.sleep(0.05)
        assert len(seen) >= 20 and all(load == during for load in seen)  # never gone, never changed
        assert during.free_blocks >= before.free_blocks and reporter.renewals >= 5
        assert redis_client.exists(Keys(CLUSTER).alive("prefill-0"))
        after = wait_for(lambda: (load := read_loads(redis_client, CLUSTER, ["prefill-0"])["prefill-0"]) != during
                         and load, what="a report taken after the step")
        assert after.free_blocks > during.free_blocks and after.updated_at > during.updated_at
    finally:
        reporter.stop()


def test_a_step_past_the_limit_lets_the_worker_lapse_and_it_returns_after(redis_server, redis_client, monkeypatch):
    monkeypatch.setattr(engine_worker, "REPORT_WAIT_S", 0.1)
    monkeypatch.setattr(engine_worker, "STEP_BEAT_LIMIT_S", 0.3)
    worker = stand_in_worker([0])
    reporter = WorkerReporter(redis_server.url, CLUSTER, "prefill-0", worker._report_snapshot, interval_s=0.05,
                              heartbeat_ttl_s=TTL_S)
    try:
        wait_for(lambda: read_loads(redis_client, CLUSTER, ["prefill-0"]), what="the first report")
        step = hold_engine(worker, 0.3 + 3 * TTL_S)
        wait_for(lambda: not read_loads(redis_client, CLUSTER, ["prefill-0"]), timeout_s=0.3 + 3 * TTL_S,
                 what="the hung worker's report to lapse")
        assert not redis_client.exists(Keys(CLUSTER).alive("prefill-0"))
        step.join()
        wait_for(lambda: read_loads(redis_client, CLUSTER, ["prefill-0"]), what="the report once the step ended")
    finally:
        reporter.stop()


def test_the_lock_says_how_long_its_holder_has_held_it():
    lock = StepLock()
    assert lock.held_for() == 0.0
    assert lock.acquire_within(0.01)
    time.sleep(0.05)
    assert lock.held_for() >= 0.05
    assert not lock.acquire_within(0.01)  # held: a second taker waits its bound, then gives up
    lock.release()
    assert lock.held_for() == 0.0
    with lock.step_turn():
        assert lock.held_for() >= 0.0 and not lock.acquire_now()
    assert lock.acquire_now()
    lock.release()
