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
        if best == proposal.current:
            self._streak = (None, 0)
            return "the current split is the best"
        fewer = best.workers < proposal.current.workers
        if not fewer and proposal.gain < self.min_gain:
            self._streak = (None, 0)
            return f"predicted gain {proposal.gain:+.0%} is under {self.min_gain:.0%}"
        seen, count = self._streak
        count = count + 1 if seen == best else 1
        self._streak = (best, count)
        if count < self.confirmations:
            return f"proposed {count} of {self.confirmations} looks in a row"
        if now - self._last_action_at < self.cooldown_s:
            return f"{self.cooldown_s - (now - self._last_action_at):.0f} s of cooldown left"
        return None

    def acted(self, now: float) -> None:
        self._last_action_at = now
        self._streak = (None, 0)
