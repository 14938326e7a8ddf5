"""When the live planner acts on a proposal: never on one look, never on a small predicted
gain, never twice within a cooldown, so that the pools do not flap between two splits whose
goodput differs by noise."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.plan.live.propose import Proposal, Split


@dataclass
class Hysteresis:
    min_gain: float
    confirmations: int
    cooldown_s: float
    _streak: tuple[Split | None, int] = (None, 0)  # the split proposed by the latest looks, and how many in a row
    _last_action_at: float = float("-inf")

    def offer(self, proposal: Proposal, now: float) -> str | None:
        """Why not to act on ``proposal`` now, or None to act."""
        best = proposal.best
        unworthy = self.unworthy(proposal)
        if unworthy is not None:
            self._streak = (None, 0)
            return unworthy
        seen, count = self._streak
        count = count + 1 if seen == best else 1
        self._streak = (best, count)
        if count < self.confirmations:
            return f"proposed {count} of {self.confirmations} looks in a row"
        if now - self._last_action_at < self.cooldown_s:
            return f"{self.cooldown_s - (now - self._last_action_at):.0f} s of cooldown left"
        return None

    def unworthy(self, proposal: Proposal) -> str | None:
        """Why ``proposal`` is not worth a resize whatever the looks before it (the same split,
        or a small gain with no fewer workers), or None."""
        if proposal.best == proposal.current:
            return "the current split is the best"
        fewer = proposal.best.workers < proposal.current.workers
        if not fewer and proposal.gain < self.min_gain:
            return f"predicted gain {proposal.gain:+.0%} is under {self.min_gain:.0%}"
        return None

    @property
    def last_action_at(self) -> float:
        return self._last_action_at

    def acted(self, now: float) -> None:
        self._last_action_at = now
        self._streak = (None, 0)
