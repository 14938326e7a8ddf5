"""The live planner: every ``planner.interval_s`` a look at the last window's traffic, a
proposal of the split it needs (``propose.py``), and, past the hysteresis, a decision:
said (``advise``) or carried out by resizing the pools (``act``). Each decision is kept with
its prediction (``cluster/registry/planner_decisions.py``) and measured ``planner.measure_s`` after
it (the prediction made at the rate offered over as long before it). It runs on a thread of the
process that deployed the cluster, beside the supervisor.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Callable

from cluster.bench.metrics import class_objectives
from cluster.plan.live.hysteresis import Hysteresis
from cluster.registry.planner_decisions import Journal, PlannerDecision
from cluster.plan.live.observe import Observation, measured_profile, observe
from cluster.plan.live.propose import Bounds, Prediction, Proposal, Split, predict_settled, propose, step_fit
from cluster.parallel.tp_runner import threads_per_rank
from cluster.plan.simulator import SimConfig, WorkerSpec
from cluster.registry.goodput import GoodputReader

log = logging.getLogger(__name__)


PLANNER_NICE = 10  # added to the planner thread's niceness (Linux: a thread's own)


def yield_to_workers(by: int = PLANNER_NICE) -> None:
    """Lowers the calling thread's CPU priority by ``by``: a look's simulations take 1-2 s of CPU
    every ``interval_s`` (the local drill's 3 splits, on 2 cores), which the workers it sizes on
    the same cores should not lose while they have steps to run. Where the platform lets no
    thread be lowered on its own, nothing changes."""
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + by))
    except (AttributeError, OSError):
        pass


class LivePlanner:
    """``split_now()``: the pools' sizes now. ``resize(split)``: makes them so (act), returning
    a line saying what it did; raises when it could not."""

    def __init__(self, spec, client, cluster: str, split_now: Callable[[], Split],
                 workers_now: Callable[[], list[str]], vocab_size: int, max_model_len: int,
                 resize: Callable[[Split], str] | None = None, clock: Callable[[], float] = time.time):
        self.spec, self.planner = spec, spec.planner
        self.client, self.cluster = client, cluster
        self.split_now, self.workers_now, self.resize = split_now, workers_now, resize
        self.vocab_size, self.max_model_len, self.clock = vocab_size, max_model_len, clock
        self.bounds = Bounds.of(self.planner, split_now().workers)
        self.measure_s = self.planner.measure_s or self.planner.window_s
        self.hysteresis = Hysteresis(self.planner.min_gain, self.planner.confirmations, self.planner.cooldown_s)
        self.journal = Journal(client, cluster)
        self.reader = GoodputReader(client, cluster)
        self._numbers = iter(range(max((d.number for d in self.journal.decisions()), default=0) + 1, 1 << 62))
        self._unmeasured: list[PlannerDecision] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-planner", daemon=True)

    def start(self) -> "LivePlanner":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def _run(self) -> None:
        yield_to_workers()
        while not self._stop.wait(self.planner.interval_s):
            try:
                self.look()
            except Exception as exc:  # noqa: BLE001 - one bad look (registry down, no fit yet) is said, not fatal
                log.warning("[planner] look failed: %s", str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)

    # -- one look ----------------------------------------------------------------------------

    def look(self) -> PlannerDecision | None:
        """Measures the decisions whose window has passed, then proposes and maybe decides."""
        now = self.clock()
        self._measure_due(now)
        observation = observe(self.reader, self.planner.window_s, now)
        current = self.split_now()
        latest = {"at": now, "mode": self.planner.mode, "current": current.label(), "observed": observation.describe()}
        if not observation.has_traffic:
            self.journal.set_latest({**latest, "proposal": "nothing to size for"})
            return None
        simulation = self._simulation()
        proposal = self.proposal(observation, current, simulation)
        why_not = self.hysteresis.offer(proposal, now)
        latest.update(proposal=proposal.describe(), waiting=why_not or "", step_fit=step_fit(simulation[0], observation),
                      workers={"current": {"prefill": current.prefill, "decode": current.decode},
                               "proposed": {"prefill": proposal.best.prefill, "decode": proposal.best.decode}},
                      predictions={s.label(): round(p.goodput_rps, 3) for s, p in sorted(proposal.predictions.items())})
        self.journal.set_latest(latest)
        if why_not is not None:
            return None
        decision = self._decide(proposal, observation, latest["step_fit"])
        self.hysteresis.acted(decision.at)
        return decision

    def proposal(self, observation: Observation, current: Split,
                 simulation: tuple[Callable[[str], WorkerSpec], SimConfig] | None = None) -> Proposal:
        spec_for, config = simulation or self._simulation()
        return propose(observation, current, self.bounds, spec_for, config, class_objectives(self.spec.router),
                       self.vocab_size)

    def _simulation(self) -> tuple[Callable[[str], WorkerSpec], SimConfig]:
        """The workers as they measured themselves, and the simulator's settings."""
        workers = self.workers_now()
        roles = {w: w.rsplit("-", 1)[0] for w in workers}
        tps = {w: self.spec.pool(role).tp for w, role in roles.items() if role in ("prefill", "decode")}
        profile, nodes = measured_profile(self.client, self.cluster, workers, tps, self.max_model_len)
        pools = [self.spec.pool(role) for role in ("prefill", "decode")]
        # CPU workers of one node share its cores: a split's steps slow each other as they overlap.
        one_node = len(nodes) == 1 and "" not in nodes  # workers that did not say their node: none shared
        shared = os.cpu_count() if one_node and all(p.device == "cpu" for p in pools) else None
        config = SimConfig(router=self.spec.router, duration_s=self.planner.window_s, shared_cores=shared)

        def spec_for(role: str) -> WorkerSpec:
            spec = profile.spec(role)
            return replace(spec, threads=self.spec.pool(role).threads or threads_per_rank(spec.tp))

        return spec_for, config

    def _decide(self, proposal: Proposal, observation: Observation, fit: str = "") -> PlannerDecision:
        acted, detail, after = False, "", proposal.current
        if self.planner.mode == "act":
            if self.resize is None:
                detail = "this deployment cannot resize itself"
            else:
                try:
                    detail, acted, after = self.resize(proposal.best), True, proposal.best
                except Exception as exc:  # noqa: BLE001 - a failed resize is a decision that did not happen
                    detail = f"resize failed: {str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}"
        predicted, observed = self._prediction(proposal, observation, after, fit)
        decision = PlannerDecision(next(self._numbers), self.clock(), self.planner.mode, proposal.current.label(),
                                   proposal.best.label(), acted, predicted.goodput_rps, predicted.attainment,
                                   observed, detail)
        self.journal.add(decision)
        self._unmeasured.append(decision)
        log.warning("[planner] %s", decision.line())
        return decision

    def _prediction(self, proposal: Proposal, observation: Observation, split: Split,
                    fit: str = "") -> tuple[Prediction, str]:
        """What the decision predicts of ``split`` and the traffic it says it was taken for: the
        proposal's simulation of it averaged over ``DECISION_SEEDS`` workloads (``predict_settled``),
        or, where ``measure_s`` is longer than the window, the same at the rate offered over
        ``measure_s`` before the decision (the window's lengths and classes kept: they are what
        shifted). A drill's decision predicted from its 20 s window
        0.64 req/s and 0.40 was measured after it; at the rate that came, the same simulation said 0.41.
        The words say the traffic and what the workers' fits took one of its requests to cost (``fit``)."""
        described = f"{observation.describe()}; {fit}" if fit else observation.describe()
        spec_for, config = self._simulation()
        steady = observe(self.reader, self.measure_s, observation.at) if self.measure_s > observation.window_s else None
        if steady is None or not steady.has_traffic:
            return predict_settled(observation, split, spec_for, config, class_objectives(self.spec.router),
                                   self.vocab_size, first=proposal.predictions[split]), described
        predicted = predict_settled(replace(observation, rate_rps=steady.rate_rps), split, spec_for, config,
                                    class_objectives(self.spec.router), self.vocab_size)
        return predicted, f"{described}; predicted at {steady.rate_rps:.2f} req/s (last {self.measure_s:g} s)"

    def _measure_due(self, now: float) -> None:
        """Each decision ``measure_s`` on: the goodput measured over that time, and what the
        simulator predicts of the split that ran for the traffic that came in it."""
        window = self.measure_s
        for decision in [d for d in self._unmeasured if now >= d.at + window]:
            after = observe(self.reader, window, decision.at + window)
            done = self.journal.measured(decision, after.goodput_rps, after.attainment, now,
                                         *self._expected(decision, after))
            self._unmeasured.remove(decision)
            log.warning("[planner] measured: %s", done.line())

    def _expected(self, decision: PlannerDecision, after: Observation) -> tuple[float | None, float | None]:
        """(the rate offered after the decision, the simulated goodput of the split that ran at
        that traffic), or Nones where it had none to simulate or the simulation failed."""
        if not after.has_traffic:
            return None, None
        ran = Split.parse(decision.proposed if decision.acted else decision.current)
        try:
            spec_for, config = self._simulation()
            expected = predict_settled(after, ran, spec_for, config, class_objectives(self.spec.router),
                                       self.vocab_size)
        except Exception as exc:  # noqa: BLE001 - a measurement without its check, said, not fatal
            log.warning("[planner] could not simulate %s for the traffic after decision %d: %s", ran.label(),
                        decision.number, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
            return after.rate_rps, None
        return after.rate_rps, expected.goodput_rps

