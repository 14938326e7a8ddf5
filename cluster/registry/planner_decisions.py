"""The live planner's decisions, each kept with its prediction and, a window after it, the
goodput measured: so that every decision can be checked against what it did, and the planner's
simulator against the cluster.

One Redis hash of JSON records by decision number, the latest ``DECISIONS_KEPT``, and the
latest look (what ``tandem status`` shows). A decision's predicted goodput is that of the split
that ran after it: the new one when it acted, the current one when it only advised."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace

import redis

from cluster.registry.keys import Keys

DECISIONS_KEPT = 100


@dataclass(frozen=True)
class PlannerDecision:
    number: int
    at: float
    mode: str  # "advise" or "act"
    current: str  # the split when it was taken ("1P+2D") ...
    proposed: str  # ... and the one proposed
    acted: bool  # resized to ``proposed`` (act), or only said (advise, or act that failed)
    predicted_goodput_rps: float  # of the split that ran after it
    predicted_attainment: float
    observed: str  # the traffic it was taken for, in words
    detail: str = ""  # why it did not act, or how the resize went
    measured_goodput_rps: float | None = None  # over the window after it
    measured_attainment: float | None = None
    measured_at: float | None = None

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured goodput; None until measured or when none was."""
        if self.measured_goodput_rps is None or self.measured_goodput_rps <= 0:
            return None
        return (self.predicted_goodput_rps - self.measured_goodput_rps) / self.measured_goodput_rps

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "PlannerDecision":
        return cls(**json.loads(raw))

    def line(self) -> str:
        when = time.strftime("%H:%M:%S", time.gmtime(self.at))
        verb = "resized" if self.acted else "advised" if self.mode == "advise" else "did not resize"
        text = (f"{when} {verb} {self.current} -> {self.proposed}: predicted {self.predicted_goodput_rps:.2f} req/s "
                f"({self.predicted_attainment:.0%})")
        if self.measured_goodput_rps is not None:
            e = self.error
            text += (f", measured {self.measured_goodput_rps:.2f} req/s ({self.measured_attainment:.0%})"
                     + (f", {e:+.0%}" if e is not None else ""))
        return text + (f"; {self.detail}" if self.detail else "")


class Journal:
    def __init__(self, client: redis.Redis, cluster: str):
        self.client = client
        keys = Keys(cluster)
        self.decisions_key, self.latest_key = keys.planner_decisions, keys.planner_latest

    def add(self, decision: PlannerDecision) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.decisions_key, str(decision.number), decision.to_json())
        if decision.number > DECISIONS_KEPT:
            pipe.hdel(self.decisions_key, str(decision.number - DECISIONS_KEPT))
        pipe.execute()

    def measured(self, decision: PlannerDecision, goodput_rps: float, attainment: float, at: float) -> PlannerDecision:
        done = replace(decision, measured_goodput_rps=goodput_rps, measured_attainment=attainment, measured_at=at)
        self.client.hset(self.decisions_key, str(decision.number), done.to_json())
        return done

    def decisions(self) -> list[PlannerDecision]:
        """Oldest first."""
        raw = self.client.hgetall(self.decisions_key)
        return sorted((PlannerDecision.from_json(v) for v in raw.values()), key=lambda d: d.number)

    def set_latest(self, look: dict) -> None:
        self.client.set(self.latest_key, json.dumps(look, separators=(",", ":")))

    def latest(self) -> dict | None:
        raw = self.client.get(self.latest_key)
        return json.loads(raw) if raw else None
