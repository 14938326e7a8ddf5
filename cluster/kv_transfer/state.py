"""The life cycle of one request's KV transfer, as an explicit state machine.

    WAITING ──> TRANSFERRING ──> DONE
       │             │
       └─────────────┴──> FAILED | ABORTED

Each half (sender on the prefill side, receiver on the decode side) keeps one record per
request. A record past its deadline fails; every terminal state is final, so a late message
of a peer cannot resurrect a transfer whose blocks were already freed.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class TransferState(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.ABORTED)


_ALLOWED = {
    TransferState.WAITING: {TransferState.TRANSFERRING, TransferState.FAILED, TransferState.ABORTED},
    TransferState.TRANSFERRING: {TransferState.DONE, TransferState.FAILED, TransferState.ABORTED},
}


class TransferStateError(RuntimeError):
    pass


@dataclass
class TransferRecord:
    """One request's transfer on one side: how many layers have moved, and why it ended."""

    request_id: str
    num_layers: int
    deadline: float  # time.monotonic() by which the last layer must have moved
    state: TransferState = TransferState.WAITING
    layers_done: int = 0
    error: str | None = None
    history: list[TransferState] = field(default_factory=lambda: [TransferState.WAITING])

    @classmethod
    def start(cls, request_id: str, num_layers: int, timeout_s: float) -> "TransferRecord":
        return cls(request_id, num_layers, time.monotonic() + timeout_s)

    def _move(self, target: TransferState, error: str | None = None) -> None:
        if target not in _ALLOWED.get(self.state, set()):
            raise TransferStateError(f"transfer {self.request_id}: cannot go from {self.state.value} to {target.value}")
        self.state = target
        self.error = error
        self.history.append(target)

    def layer_moved(self) -> None:
        """One more layer sent (or received); the last one completes the transfer."""
        if self.state is TransferState.WAITING:
            self._move(TransferState.TRANSFERRING)
        if self.state is not TransferState.TRANSFERRING:
            raise TransferStateError(f"transfer {self.request_id}: layer moved while {self.state.value}")
        self.layers_done += 1
        if self.layers_done == self.num_layers:
            self._move(TransferState.DONE)

    def fail(self, reason: str) -> bool:
        """Marks the transfer failed; False (and no change) if it had already ended."""
        if self.state.terminal:
            return False
        self._move(TransferState.FAILED, reason)
        return True

    def abort(self, reason: str = "aborted") -> bool:
        if self.state.terminal:
            return False
        self._move(TransferState.ABORTED, reason)
        return True

    def expired(self, now: float | None = None) -> bool:
        return not self.state.terminal and (now if now is not None else time.monotonic()) > self.deadline

    def check_deadline(self, now: float | None = None) -> bool:
        """Fails the transfer if its deadline has passed; True when that happened now."""
        if self.expired(now):
            return self.fail(f"deadline passed after {self.layers_done} of {self.num_layers} layers")
        return False
