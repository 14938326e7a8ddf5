"""A worker's drain, as a state machine with no Ray in it: what the deployment waits for between
marking a worker draining and stopping it (``cluster/deployment/scaling.py`` feeds it what it sees).

    announced ──every router places by the record that says so──▶ emptying ──nothing in flight──▶ stopping
        │ (or ``router_wait_s`` passed: a router that never                │ (``timeout_s`` passed: what is still in
        │  answers does not hold the drain up)                             │  flight moves when the worker stops)
        └──────────────────────────────────────────────────────────────────┘

``announced``: the membership record that names the worker draining is written (version
``version``); routers that read it place on it no more. ``emptying``: no new request comes, so
the requests it still holds are the last; they finish. A worker is empty when ``QUIET_CHECKS``
looks in a row find nothing in flight (one look could fall between a placement made just before
the router's word and its request reaching the worker). ``stopping``: the deployment stops it;
a request still in flight (a drain past its timeout) moves, as from a worker that died: its
stream resumes on another worker without repeating or losing a token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

ANNOUNCED, EMPTYING, STOPPING = "announced", "emptying", "stopping"
QUIET_CHECKS = 2  # looks in a row that find nothing in flight before a worker counts as empty


@dataclass(frozen=True)
class DrainLook:
    """What one look at the cluster found: the membership version each live router places by,
    and the requests the draining worker holds."""

    now: float
    router_versions: Sequence[int] = ()
    in_flight: int = 0


@dataclass
class Drain:
    worker: str
    version: int  # of the membership record that names it draining
    started_at: float
    timeout_s: float = 60.0  # for its requests to finish; then it stops, and they move
    router_wait_s: float = 10.0  # for every router to place by ``version``
    phase: str = ANNOUNCED
    quiet: int = 0  # looks in a row that found nothing in flight
    left_in_flight: int = 0  # requests still in flight when it stopped (they move)
    history: list[str] = field(default_factory=list)  # the phases it went through, in order

    def __post_init__(self) -> None:
        self.history.append(self.phase)

    def step(self, look: DrainLook) -> str:
        """The phase after ``look``."""
        if self.phase == ANNOUNCED:
            heard = all(v >= self.version for v in look.router_versions)
            if heard or look.now - self.started_at >= self.router_wait_s:
                self._enter(EMPTYING)
        if self.phase == EMPTYING:
            self.quiet = self.quiet + 1 if look.in_flight == 0 else 0
            if self.quiet >= QUIET_CHECKS:
                self._enter(STOPPING)
            elif look.now - self.started_at >= self.timeout_s:
                self.left_in_flight = look.in_flight
                self._enter(STOPPING)
        return self.phase

    @property
    def done(self) -> bool:
        return self.phase == STOPPING

    def _enter(self, phase: str) -> None:
        self.phase = phase
        self.history.append(phase)
