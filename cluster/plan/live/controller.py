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
from cluster.plan.live.calibrate import Calibration, calibrate, scaled_specs
from cluster.plan.live.hysteresis import Hysteresis
from cluster.registry.planner_decisions import Journal, PlannerDecision
from cluster.plan.live.observe import Observation, measured_profile, observe
from cluster.plan.live.propose import Bounds, Prediction, Proposal, Split, predict, propose, step_fit
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
        self.calibration: Calibration | None = None  # the latest, found before the latest decision
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
        proposal, why_not = self._calibrated(proposal, observation, current, latest)
        self.journal.set_latest({**latest, "waiting": why_not or ""})
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

    @property
    def step_scale(self) -> float:
        return self.calibration.scale if self.calibration is not None else 1.0

    def _calibrated(self, proposal: Proposal, observation: Observation, current: Split,
                    latest: dict) -> tuple[Proposal, str | None]:
        """Before acting: the step-time scale at which the current split reproduces the
        attainment measured over the window (``calibrate.py``), and the proposal made again at
        it; with why not to act where, so simulated, the proposal is no longer worth it."""
        if observation.at - self.hysteresis.last_action_at < observation.window_s:
            return proposal, None  # the window saw another split for a while: the scale found before is kept
        spec_for, config = self._simulation(scale=1.0)
        simulated = proposal.predictions[current].attainment if self.step_scale == 1.0 else None  # at the fits
        found = calibrate(observation, current, spec_for, config, class_objectives(self.spec.router), self.vocab_size,
                          unscaled=simulated)
        if found is None:
            return proposal, None
        unchanged = found.scale == self.step_scale  # the proposal was made at it
        self.calibration = found
        latest["calibration"] = found.describe()
        if unchanged:
            return proposal, None
        again = self.proposal(observation, current, (scaled_specs(spec_for, found.scale), config))
        latest["proposal"] = again.describe()
        latest["predictions"] = {s.label(): round(p.goodput_rps, 3) for s, p in sorted(again.predictions.items())}
        if again.best != proposal.best:
            return again, f"calibrated ({found.describe()}), it proposes {again.best.label()}"
        unworthy = self.hysteresis.unworthy(again)
        return again, (f"calibrated ({found.describe()}): {unworthy}" if unworthy else None)

    def _simulation(self, scale: float | None = None) -> tuple[Callable[[str], WorkerSpec], SimConfig]:
        """The workers as they measured themselves, their step times times ``scale`` (the
        latest calibration's where not given), and the simulator's settings."""
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

        return scaled_specs(spec_for, self.step_scale if scale is None else scale), config

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
                                   observed, detail, step_scale=self.step_scale)
        self.journal.add(decision)
        self._unmeasured.append(decision)
        log.warning("[planner] %s", decision.line())
        return decision

    def _prediction(self, proposal: Proposal, observation: Observation, split: Split,
                    fit: str = "") -> tuple[Prediction, str]:
        """What the decision predicts of ``split`` and the traffic it says it was taken for: the
        proposal's prediction, or, where ``measure_s`` is longer than the window, the same
        simulation at the rate offered over ``measure_s`` before the decision (the window's
        lengths kept: they are what shifted). A drill's decision predicted from its 20 s window
        0.64 req/s and 0.40 was measured after it; at the rate that came, the same simulation said 0.41.
        The words say the traffic and what the workers' fits took one of its requests to cost (``fit``)."""
        described = f"{observation.describe()}; {fit}" if fit else observation.describe()
        if self.calibration is not None:
            described += f"; {self.calibration.describe()}"
        if self.measure_s <= observation.window_s:
            return proposal.predictions[split], described
        steady = observe(self.reader, self.measure_s, observation.at)
        if not steady.has_traffic:
            return proposal.predictions[split], described
        spec_for, config = self._simulation()
        predicted = predict(replace(observation, rate_rps=steady.rate_rps), split, spec_for, config,
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
            spec_for, config = self._simulation(scale=decision.step_scale)  # the model that made the decision
            expected = predict(after, ran, spec_for, config, class_objectives(self.spec.router), self.vocab_size)
        except Exception as exc:  # noqa: BLE001 - a measurement without its check, said, not fatal
            log.warning("[planner] could not simulate %s for the traffic after decision %d: %s", ran.label(),
                        decision.number, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
            return after.rate_rps, None
        return after.rate_rps, expected.goodput_rps

