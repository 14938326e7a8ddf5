"""Which prefill:decode split the traffic just seen needs: each split within the planner's
bounds simulated with the cluster's own router and engine scheduler (``cluster/plan/simulator.py``)
at the observed rate and lengths, and the one that meets the SLO classes with the fewest
workers chosen (the highest goodput where none meets them)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from cluster.bench.arrivals import Arrivals
from cluster.bench.metrics import ATTAINMENT_GOAL, Objectives, RequestResult, summarize
from cluster.bench.workloads import Length, Workload, synthetic
from cluster.plan.simulator import Pools, SimConfig, WorkerSpec, simulate
from cluster.plan.live.observe import Observation

LENGTH_SPREAD = 0.25  # prompt and output lengths drawn normal around the observed means, this relative spread
# The least and most requests one simulation sends, whatever the window: the prediction is of
# steady traffic, so a simulation runs until its queues have built up, however long that takes
# in simulated time. Sending only a window's worth (20 s: about 10 requests at the local drill's
# 0.48 req/s of 1,024-token prompts) from an empty cluster put 2P+1D anywhere from 65% to 100%
# attainment by the seed alone (10 seeds); 80 requests, judged after the warm-up, within 83-95%
# (6 seeds; 120: 82-90%, at 1.6x the cost: a look's three splits took 1.5 s against 1.0 on
# this shared 2-core machine, and the planner shares the cores it sizes).
SIMULATED_REQUESTS = (80, 400)
# The first requests a simulation sends, this share of them, are not judged: they find the
# cluster empty (no queue yet), which the traffic after a decision never does.
WARM_UP_SHARE = 0.25
# A decision's prediction, and its check after, average this many simulations (seeds): one of
# 80 requests put 2P+1D of the local drill (0.5 req/s of 876-token prompts on 2 shared cores) at
# 100%, 80% or 92% attainment by its seed alone.
DECISION_SEEDS = 4


@dataclass(frozen=True, order=True)
class Split:
    prefill: int
    decode: int

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def label(self) -> str:
        return f"{self.prefill}P+{self.decode}D"

    @classmethod
    def parse(cls, label: str) -> "Split":
        """The split a ``label()`` names ("2P+1D")."""
        prefill, _, decode = label.partition("P+")
        return cls(int(prefill), int(decode.rstrip("D")))


@dataclass(frozen=True)
class Bounds:
    prefill_min: int
    prefill_max: int
    decode_min: int
    decode_max: int
    max_workers: int
    min_workers: int = 0  # a search that only moves workers between the roles: as many as max_workers

    def splits(self) -> list[Split]:
        return [Split(p, d) for p in range(self.prefill_min, self.prefill_max + 1)
                for d in range(self.decode_min, self.decode_max + 1) if self.min_workers <= p + d <= self.max_workers]

    @classmethod
    def of(cls, spec, workers_now: int) -> "Bounds":
        """The topology's ``planner`` bounds, nulls filled from the workers it starts with."""
        most = spec.max_workers or workers_now
        return cls(spec.prefill_min, spec.prefill_max or most - spec.decode_min, spec.decode_min,
                   spec.decode_max or most - spec.prefill_min, most, spec.min_workers or 0)


@dataclass(frozen=True)
class Prediction:
    """A split's simulated attainment, and the goodput it gives at the observed rate: the rate
    times the attainment, what the registry then measures over a window of steady traffic (a
    simulation's own met-over-span also counts its ramp and its tail)."""

    goodput_rps: float
    attainment: float


@dataclass(frozen=True)
class Proposal:
    current: Split
    best: Split
    predictions: dict[Split, Prediction] = field(compare=False)

    @property
    def gain(self) -> float:
        """Predicted goodput of the best split over the current one's, less 1."""
        now, best = self.predictions[self.current].goodput_rps, self.predictions[self.best].goodput_rps
        return best / now - 1.0 if now > 0 else (float("inf") if best > 0 else 0.0)

    def describe(self) -> str:
        b, c = self.predictions[self.best], self.predictions[self.current]
        if self.best == self.current:
            return (f"keep {self.current.label()}: predicted goodput {c.goodput_rps:.2f} req/s, "
                    f"attainment {c.attainment:.0%}")
        return (f"{self.current.label()} -> {self.best.label()}: predicted goodput {b.goodput_rps:.2f} req/s "
                f"(attainment {b.attainment:.0%}) against {c.goodput_rps:.2f} ({c.attainment:.0%}) now")


def chosen(predictions: dict[Split, Prediction], current: Split | None = None, goal: float = ATTAINMENT_GOAL) -> Split:
    """The split meeting the attainment goal with the fewest workers (then the highest
    goodput); where none meets it, the highest goodput (then the fewest workers). On a tie
    the ``current`` split stays: moving a worker costs a drain for nothing."""
    def stays(s: Split) -> bool:
        return s != current

    meeting = [s for s, p in predictions.items() if p.attainment >= goal]
    if meeting:
        return min(meeting, key=lambda s: (s.workers, -predictions[s].goodput_rps, stays(s), s))
    return min(predictions, key=lambda s: (-predictions[s].goodput_rps, s.workers, stays(s), s))


def propose(observation: Observation, current: Split, bounds: Bounds,
            spec_for: Callable[[str], WorkerSpec], config: SimConfig, class_objectives: dict[str, Objectives],
            vocab_size: int, seed: int = 0, max_requests: int = SIMULATED_REQUESTS[1]) -> Proposal:
    """Every split within ``bounds`` (and the current one) simulated under the observed traffic."""
    predictions = {split: predict(observation, split, spec_for, config, class_objectives, vocab_size, seed,
                                  max_requests)
                   for split in sorted({current, *bounds.splits()})}
    return Proposal(current, chosen(predictions, current), predictions)


def predict(observation: Observation, split: Split, spec_for: Callable[[str], WorkerSpec], config: SimConfig,
            class_objectives: dict[str, Objectives], vocab_size: int, seed: int = 0,
            max_requests: int = SIMULATED_REQUESTS[1]) -> Prediction:
    """One split simulated under the observed traffic (the same workload for every split of a
    look: its seed and the observation fix it): ``simulated_requests`` of them, all sent
    (``config.duration_s`` only sets how many), judged after the warm-up (``steady``)."""
    count = simulated_requests(observation.rate_rps, config.duration_s or observation.window_s, max_requests)
    prompt, output = observation.mean_prompt_tokens, observation.mean_output_tokens
    workload = with_classes(synthetic(count, Length("normal", prompt, LENGTH_SPREAD * prompt),
                                      Length("normal", output, LENGTH_SPREAD * output), vocab_size, seed),
                            known_shares(observation.class_shares, config) or ((config.router.default_class, 1.0),))
    arrivals = Arrivals("poisson", rate=observation.rate_rps, seed=seed)
    pools = Pools(prefill=(split.prefill, spec_for("prefill")), decode=(split.decode, spec_for("decode")))
    result = simulate(pools, workload, arrivals, replace(config, duration_s=None))
    attainment = summarize(steady(result.results), None, class_objectives)["goodput"]["attainment"]
    return Prediction(observation.rate_rps * attainment, attainment)


def predict_settled(observation: Observation, split: Split, spec_for: Callable[[str], WorkerSpec], config: SimConfig,
                    class_objectives: dict[str, Objectives], vocab_size: int, seeds: int = DECISION_SEEDS,
                    first: Prediction | None = None) -> Prediction:
    """``predict`` averaged over ``seeds`` workloads (seed 0 first: ``first`` where the caller
    has it). A look compares splits on one seed (the same traffic for each); the prediction a
    decision is kept and checked with is this one."""
    runs = [first if first is not None else predict(observation, split, spec_for, config, class_objectives, vocab_size)]
    runs += [predict(observation, split, spec_for, config, class_objectives, vocab_size, seed)
             for seed in range(1, seeds)]
    return Prediction(sum(p.goodput_rps for p in runs) / len(runs), sum(p.attainment for p in runs) / len(runs))


def known_shares(shares: Sequence[tuple[str, float]], config: SimConfig) -> tuple[tuple[str, float], ...]:
    """The shares of the classes the router knows (a class recorded before its topology changed is left out)."""
    known = {c.name for c in config.router.slo_classes}
    return tuple((name, share) for name, share in shares if name in known)


def with_classes(workload: Workload, shares: Sequence[tuple[str, float]]) -> Workload:
    """The workload's sessions given SLO classes in proportion to ``shares``, spread evenly
    through them (session i takes the class whose stretch of the cumulative shares holds
    (i + 0.5) / n). A simulated request is judged by its class's objectives, as the registry
    judged the requests observed; left without a class, it would be judged by none, and a late
    first token counted as met (the planner's simulations did so: in a local drill they put 2P+1D
    at 96-98% attainment where 77-79% was measured)."""
    n = len(workload.sessions)
    bounds, total = [], 0.0
    for name, share in shares:
        total += share
        bounds.append((total, name))
    scale = total or 1.0

    def class_at(i: int) -> str:
        at = (i + 0.5) / n * scale
        return next((name for bound, name in bounds if at < bound), bounds[-1][1])

    return replace(workload, sessions=tuple(replace(s, slo_class=class_at(i)) for i, s in enumerate(workload.sessions)))


def simulated_requests(rate_rps: float, duration_s: float, max_requests: int = SIMULATED_REQUESTS[1]) -> int:
    """How many requests one prediction simulates: the rate's over ``duration_s``, within
    ``SIMULATED_REQUESTS`` (``max_requests`` the most)."""
    return min(max(round(rate_rps * duration_s), SIMULATED_REQUESTS[0]), max_requests)


def steady(results: Sequence[RequestResult]) -> list[RequestResult]:
    """The results judged: those sent after the first ``WARM_UP_SHARE`` of them (by send time)."""
    ordered = sorted(results, key=lambda r: r.sent_at)
    return ordered[int(len(ordered) * WARM_UP_SHARE):]


def step_fit(spec_for: Callable[[str], WorkerSpec], observation: Observation) -> str:
    """What the simulation takes a request of the observed lengths to cost, by the workers' fits:
    its prompt's prefill on a prefill worker and a one-sequence decode step at its context on a
    decode worker (what to hold against the steps the workers then measure)."""
    if not observation.has_traffic:
        return ""
    prompt, output = round(observation.mean_prompt_tokens), round(observation.mean_output_tokens)
    prefill, decode = spec_for("prefill").model, spec_for("decode").model
    return (f"a {prompt}-token prompt's prefill {prefill.prefill_seconds(prompt):.2f} s; a decode step of one "
            f"sequence at {prompt + output} tokens {1e3 * decode.decode_step_seconds(1, prompt + output):.0f} ms")
