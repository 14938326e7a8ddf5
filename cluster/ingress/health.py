"""Health that means serving: each ingress replica checks, every ``PERIOD_S``, that some
worker can generate, and says so through the gRPC health service (SERVING / NOT_SERVING),
Serve's ``check_health`` and the ``tandem_serving`` gauge. (Its router runs in the replica's
own process: while the replica answers, so does its router.)

A worker can generate when it answers its ``status`` call within ``TIMEOUT_S`` with its engine
loop running (``alive``), and the replica's router has not marked it failed. Generating workers
are the decode and colocated ones: without prefill workers a decode worker still serves the
prompts it may prefill itself, so their loss is not a loss of service (placements say why, per
request).

It recovers by itself: a worker that answers again under its name (restarted, or no longer
wedged) is looked up afresh, and one the router had marked failed is handed back to it
(``worker_returned``), so placements use it again.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Awaitable, Callable

PERIOD_S = 2.0
TIMEOUT_S = 10.0  # generous: a busy worker answers its status call between two engine steps


class HealthMonitor:
    def __init__(self, path, on_change: Callable[[bool], Awaitable[None]] | None = None, metrics=None,
                 period_s: float = PERIOD_S, timeout_s: float = TIMEOUT_S):
        self.path = path
        self.info = path.info
        self.on_change = on_change
        self.metrics = metrics
        self.period_s, self.timeout_s = period_s, timeout_s
        self.serving: bool | None = None  # None until the first check
        self.reason = "not checked yet"
        self.checked_at = 0.0

    async def run(self) -> None:
        """Checks for ever (cancel the task to stop)."""
        while True:
            await self.check_now()
            await asyncio.sleep(self.period_s)

    async def check_now(self) -> bool:
        try:
            serving, reason = await self.check()
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a failed check
            serving, reason = False, f"health check failed: {exc}"
        changed = serving != self.serving
        self.serving, self.reason, self.checked_at = serving, reason, time.time()
        if self.metrics is not None:
            self.metrics.serving(serving)
        if changed:
            print(f"[tandem] ingress: {'serving' if serving else 'not serving: ' + reason}", file=sys.stderr,
                  flush=True)
            if self.on_change is not None:
                await self.on_change(serving)
        return serving

    async def check(self) -> tuple[bool, str]:
        """(serving, why not)."""
        router = self.path.router
        topology = router.topology  # the deployment's workers now (it resizes)
        workers = await self.worker_statuses(topology.workers)
        failed = set(router.failed_workers)
        returned = [name for name, status in workers.items() if status.get("state") == "alive" and name in failed]
        for name in returned:  # serving means the router places on it again
            router.worker_returned(name)
            failed.discard(name)
        generating = topology.decode + topology.colocated
        able = [n for n in generating if workers[n].get("state") == "alive" and n not in failed
                and n not in topology.draining]
        if able:
            return True, ""
        states = ", ".join(f"{n} {'failed' if n in failed else workers[n].get('state', 'dead')}" for n in generating)
        return False, f"no decode worker can generate ({states})"

    async def worker_statuses(self, names) -> dict[str, dict]:
        """Each worker's status; ``{"state": "dead"}`` for one that is gone or does not answer
        (its handle is dropped, so that one started again under its name is found)."""
        handles = {}
        for name in names:
            try:
                handles[name] = self.path.worker(name)
            except LookupError:
                pass
        statuses = await self._gather(handles, "status")
        out = {}
        for name in names:
            status = statuses.get(name)
            if status is None:
                self.path.forget_worker(name)
                status = {"name": name, "role": name.rpartition("-")[0], "state": "dead"}
            out[name] = status
        return out

    async def _gather(self, handles: dict[str, object], method: str) -> dict[str, dict | None]:
        async def call(handle):
            try:
                return await asyncio.wait_for(getattr(handle, method).remote(), self.timeout_s)
            except Exception:  # noqa: BLE001 - dead, gone or too slow: no answer
                return None

        answers = await asyncio.gather(*(call(h) for h in handles.values()))
        return dict(zip(handles, answers))
