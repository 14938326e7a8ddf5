"""A bounded benchmark run: sessions started by an arrival process (or a closed loop of
clients), each turn sent through a backend, every request's timings kept.

Bounds: the workload's size (``--num-requests``) and a time limit (``--duration``): no
session starts and no turn is sent after it; requests in flight then get their own timeout
(``--timeout``) to end. A progress line on stderr says how far the run is.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from cluster.bench.arrivals import Arrivals
from cluster.bench.clients import SendOptions, wall_clock
from cluster.bench.metrics import RequestResult
from cluster.bench.workloads import FIRST_TOKEN_ID, Session, Workload

BAR_WIDTH = 24


def answer_tokens(result: RequestResult) -> list[int]:
    """What a later turn carries as the answer to this one: the token ids the server sent, or,
    where the API gives only text, as many filler tokens as it generated."""
    if result.output_token_ids:
        return list(result.output_token_ids)
    return [FIRST_TOKEN_ID] * result.completion_tokens


def session_start_offsets(workload: Workload, arrivals: Arrivals) -> list[float]:
    return arrivals.offsets(len(workload.sessions), [s.at_s for s in workload.sessions])


class Progress:
    """A progress line on stderr: a bar over requests (or time), what is done and failed."""

    def __init__(self, total_requests: int, duration_s: float | None, label: str = "bench", stream=None):
        self.total, self.duration_s, self.label = total_requests, duration_s, label
        self.stream = stream or sys.stderr
        self.sent = self.done = self.failed = self.rejected = 0
        self.started = time.perf_counter()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_line = 0.0

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        share = self.done / self.total if self.total else 0.0
        if self.duration_s:
            share = max(share, min(1.0, elapsed / self.duration_s))
        filled = int(round(share * BAR_WIDTH))
        limit = f" of {self.duration_s:.0f}s" if self.duration_s else ""
        return (f"[{self.label}] [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.done}/{self.total} requests "
                f"done ({self.rejected} rejected, {self.failed} failed), {self.sent - self.done} in flight, "
                f"{elapsed:.0f}s{limit}")

    def show(self, final: bool = False) -> None:
        now = time.perf_counter()
        if self._tty:
            print("\r" + self.line() + "   ", end="\n" if final else "", file=self.stream, flush=True)
        elif final or now - self._last_line >= 5.0:
            self._last_line = now
            print(self.line(), file=self.stream, flush=True)

    async def keep_showing(self, every_s: float = 0.5) -> None:
        while True:
            self.show()
            await asyncio.sleep(every_s)


@dataclass(frozen=True)
class Limits:
    duration_s: float | None = None  # no session starts or turn is sent after this


async def run(backend, workload: Workload, arrivals: Arrivals, limits: Limits, options: SendOptions,
              progress: Progress | None = None) -> list[RequestResult]:
    """Runs the workload against the backend; returns every request's result, in send order."""
    start = time.perf_counter()
    clock = wall_clock(start)
    results: list[RequestResult] = []
    deadline = limits.duration_s

    def open_now() -> bool:
        return deadline is None or clock() < deadline

    async def one_session(session: Session) -> None:
        history: list[list[int]] = []
        for turn in range(len(session.turns)):
            if turn and session.think_s:
                await asyncio.sleep(session.think_s)
            if not open_now():
                return
            prompt = session.prompt(turn, history)
            if progress:
                progress.sent += 1
            result = await backend.send(session.request_id(turn), prompt, session.turns[turn].max_tokens,
                                        session.slo_class, options, clock)
            results.append(result)
            if progress:
                progress.done += 1
                progress.failed += result.failed
                progress.rejected += result.rejected
            if not result.ok:
                return
            history.append(answer_tokens(result))

    shower = asyncio.create_task(progress.keep_showing()) if progress else None
    try:
        if arrivals.closed_loop:
            queue = iter(workload.sessions)

            async def client() -> None:
                for session in queue:
                    if not open_now():
                        return
                    await one_session(session)

            await asyncio.gather(*(client() for _ in range(arrivals.concurrency)))
        else:
            tasks = []
            for session, offset in zip(workload.sessions, session_start_offsets(workload, arrivals)):
                if deadline is not None and offset >= deadline:
                    break
                wait = offset - clock()
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(one_session(session)))
            await asyncio.gather(*tasks)
    finally:
        if shower:
            shower.cancel()
            progress.show(final=True)
    return sorted(results, key=lambda r: r.sent_at)
