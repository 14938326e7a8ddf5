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
    # The traffic offered in that window, and what the same simulation predicts of the split for
    # it: the check of the planner's model apart from its guess of the traffic to come. (A drill's
    # decision predicted 0.78 req/s from the 20 s window that set it off, 13 requests of a 0.6 req/s
    # Poisson stream; 0.50 was measured after, what the simulator gave for 0.6 req/s.)
    measured_rate_rps: float | None = None
    expected_goodput_rps: float | None = None

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured goodput; None until measured or when none was."""
        return _relative(self.predicted_goodput_rps, self.measured_goodput_rps)

    @property
    def model_error(self) -> float | None:
        """(expected - measured) / measured goodput, the prediction for the traffic that came;
        None until measured, or where that window had no traffic to simulate."""
        return None if self.expected_goodput_rps is None else _relative(self.expected_goodput_rps,
                                                                         self.measured_goodput_rps)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "PlannerDecision":
        return cls.from_mapping(json.loads(raw))

    @classmethod
    def from_mapping(cls, values: dict) -> "PlannerDecision":
        """From a mapping with this record's fields (unknown keys left out: an older or newer writer)."""
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in values.items() if k in names})

    def line(self) -> str:
        when = time.strftime("%H:%M:%S", time.gmtime(self.at))
        verb = "resized" if self.acted else "advised" if self.mode == "advise" else "did not resize"
        text = (f"{when} {verb} {self.current} -> {self.proposed}: predicted {self.predicted_goodput_rps:.2f} req/s "
                f"({self.predicted_attainment:.0%})")
        if self.measured_goodput_rps is not None:
            e = self.error
            text += (f", measured {self.measured_goodput_rps:.2f} req/s ({self.measured_attainment:.0%})"
                     + (f", {e:+.0%}" if e is not None else ""))
            if self.expected_goodput_rps is not None and self.measured_rate_rps is not None:
                m = self.model_error
                text += (f"; for the {self.measured_rate_rps:.2f} req/s that came it predicts "
                         f"{self.expected_goodput_rps:.2f}" + (f", {m:+.0%}" if m is not None else ""))
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

    def measured(self, decision: PlannerDecision, goodput_rps: float, attainment: float, at: float,
                 rate_rps: float | None = None, expected_goodput_rps: float | None = None) -> PlannerDecision:
        done = replace(decision, measured_goodput_rps=goodput_rps, measured_attainment=attainment, measured_at=at,
                       measured_rate_rps=rate_rps, expected_goodput_rps=expected_goodput_rps)
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


def _relative(predicted: float, measured: float | None) -> float | None:
    if measured is None or measured <= 0:
        return None
    return (predicted - measured) / measured
