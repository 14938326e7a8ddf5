"""Placement: for each request, which prefill worker computes its KV and which decode worker
generates, predicted TTFT and TPOT for every candidate, and admission by the request's SLO.

Placement is a pipeline, each stage in a module of its own, run in order by ``Router.route``:
filters (``router/filters.py``: live workers, pairs not cut off, the prefill shortlist, room on
the decode side); candidates with their predictions (``router/candidates.py``, from each
worker's step-time model in ``router/cost_model.py``), among them the workers that prefill a
prompt themselves (the local-or-remote decision, ``router/prefill_choice.py``); scorers
(``router/scorers.py``) weighed by the policy; and the picker (``router/picker.py``), which ranks
them and under admission control picks the best that meets the objectives, or says why none can.

The router reads two things from the registry: each live worker's load report (with the
steps its cost model is fitted to) and, per request, how many leading blocks of the prompt
each worker caches. Its own state is soft: placements it made since each worker's last
report (so a burst of requests does not all pile on the worker that looked idle), the
round-robin position, the fitted models, the requests it holds until it can place them, the
requests that ended since each worker's last report (so a worker that just went idle does not
look busy until it reports again: a placement a few ms after the last request ended, as one
stream makes, would otherwise see the last report's batch), and a running TTFT correction per
path (remote or local prefill) learned from finished requests: what the step-time model leaves
out, such as control-plane round trips and CPU contention. All of it rebuilds from the registry
and the requests that follow.

Both paths are predicted alike, so that where a decode worker may prefill a prompt itself the
sooner first token wins: a remote prefill adds the decode worker's measured call to the prefill
worker (``WorkerLoad.prefill_call_s``), the hop a local prefill does not make, and a path's
correction, when not refreshed, decays towards the other path's rather than to 0 (most of what
the model leaves out, the API and the stream, both paths share: a path used a while ago, or
never, must not look faster than the one in use for lacking it). Such a path's prediction rests
on what was measured of it before, perhaps only a start-up profile: one placement in a few goes
to it when it could serve the request too, and a path measured sooner than the one it displaced
was predicted is taken again (``router/remeasure.py``).

Admission is honest about time. A request's TTFT objective counts from when the call reached
the API (``RouteRequest.arrival``), and every class must be served in time counting what it
already spent. A class that may not wait (``reject``) is refused at once; a class that may wait
is held (``submit``) and offered again (``retry_waiting``) whenever the load changes, in
priority order, each on its own, so a request that cannot be placed never holds back one that
can. It is held only within its bound (``max_wait_ms``, by default its TTFT objective): one
whose predicted wait (``router/wait_forecast.py``: decode slots freeing at the rate the cost
model gives, behind the requests waiting ahead of it; the prefill backlog) would take it past
the bound, or its first token past the objective, is refused on arrival rather than after
waiting for nothing, and one still waiting at its bound is refused then. Every refusal carries
``retry_after_s``, when the queue is predicted to have drained enough to place a fresh one.
Whether an objective can ever be met is asked of the same prediction that placement uses, with
empty queues; one that cannot is rejected at once or runs best-effort, never waits for ever.
The correction is learned from the time after placement only (a request's own queueing is not
work the model left out), is bounded (``correction_limit_s``) and decays
(``correction_half_life_s``).

When the registry cannot be read, the router places by load only: the fewest requests it has
in flight on each side, and says so in ``status()``; it tries the registry again after
``registry_retry_s``, or, with ``probe_elsewhere``, once its owner (which probes the registry
off the placement path) says it answers again (``registry_answers``).
"""

from __future__ import annotations

import math
import time
from functools import cache
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Protocol, Sequence

from cluster.engine.block_hash import hash_token_blocks, request_hash_keys
from cluster.registry.kv_index import TierHits
from cluster.registry.load import WorkerLoad
from cluster.registry.membership import Membership
from router.candidates import Candidate, Prompt, decode_side, local_candidate, prefill_side, remote_candidates
from router.class_headroom import ArrivingClasses, tpot_limit
from router.config import RouterConfig, SloClass
from router.cost_model import StepTimeModel, measured_step_scale
from router.filters import LivePools, cut_off, on_cores_of_their_own, paired_prefill, soonest_prefill
from router.peer_pull import best_pull
from router.picker import (explain, fastest, first_meeting, first_within_headroom, never_meets, rank,
                           room_within_headroom, serves_in_time, with_room, without_room)
from router.prefill_choice import prefills_itself
from router.remeasure import PathRemeasure, path_of
from router.wait_forecast import WaitForecast, decode_slots, slot_wait_s
from router.waiting import WaitingQueue

_soonest_prefill = soonest_prefill  # the name tests/unit/test_router.py imports it by, from before router/filters.py

RESIDUAL_WEIGHT = 0.1  # of each finished request's TTFT residual in the running correction
OUTPUT_WEIGHT = 0.05  # of each finished request's output length in the running mean
TPOT_SCALE_LIMITS = (0.5, 4.0)  # the learned TPOT scale stays within these
MEASURED_SCALE_LIMIT = 16.0  # a worker's measured step scale is taken up to this
GONE_KEPT = 10_000  # requests forgotten before their placement arrived, remembered so they are not placed
HITS_TTL_S = 0.5  # how long a waiting request's prefix hits are reused before they are looked up again
RESTART_WAIT_S = 30.0  # how long requests wait for a dead worker to start again, when its deployment restarts it
ENDED_KEPT = 4096  # per decode worker, ended placements remembered until its reports show them ended
REPORT_GRACE_S = 10.0  # how long a worker whose reports stopped is still placed on (its death comes from Ray)


class RegistryUnavailable(RuntimeError):
    pass


class RegistryView(Protocol):
    """What the router reads; raises RegistryUnavailable when it cannot."""

    def loads(self, workers: Sequence[str]) -> dict[str, WorkerLoad]: ...

    def prefix_tiers(self, block_hashes: Sequence[bytes], workers: Sequence[str]) -> dict[str, TierHits]:
        """Leading blocks of the chain that each of ``workers`` holds on its device, then in its host tier."""

    def loads_and_prefix_tiers(self, workers: Sequence[str], block_hashes: Sequence[bytes]
                               ) -> tuple[dict[str, WorkerLoad], dict[str, TierHits]]:
        """Both of the above in one round trip."""


@dataclass(frozen=True)
class Topology:
    """The workers a router places on: prefill and decode pools (disaggregated), and a
    ``colocated`` pool whose workers prefill and decode every request themselves."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    block_size: int
    hash_keys: tuple = ()
    colocated: tuple[str, ...] = ()
    restarts_workers: bool = False  # the deployment starts a dead worker again (``ray.restart_workers``)
    draining: tuple[str, ...] = ()  # members of the pools that take no new placements (being removed)
    version: int = 0  # of the deployment's membership record it was read from (0: as the deployment started)

    @property
    def workers(self) -> tuple[str, ...]:
        return self.prefill + self.decode + self.colocated

    def with_membership(self, membership: Membership) -> "Topology":
        """This topology with the pools, the draining workers and the version of ``membership``."""
        return replace(self, prefill=membership.prefill, decode=membership.decode, colocated=membership.colocated,
                       draining=membership.draining, version=membership.version)


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int = 16
    slo_class: str | None = None
    cache_salt: str | None = None
    ttft_s: float | None = None  # explicit objectives, in place of the class's
    tpot_s: float | None = None
    priority: int = 0  # added to the class's; higher waits less
    arrival: float | None = None  # wall-clock time the call reached the API (None: now)
    avoid: tuple[tuple[str, str], ...] = ()  # (prefill, decode) pairs whose KV transfer failed under it
    # Placed again after admission control let it in (a worker failed under it, or its KV
    # transfer did): never refused by admission control now, placed or held as an ``admit``
    # class's request is. A quick start's only decode worker SIGKILLed under 8 streams took 5 s
    # to start again on a busy machine, and 7 of the 8 streams, already streaming, were cut with
    # "rejected by admission control: its first token is predicted 5004 ms after arrival".
    admitted: bool = False


@dataclass(frozen=True)
class Decision:
    """``place`` (prefill None: the decode worker prefills it itself), ``queue`` (try again
    later) or ``reject`` (``reason`` says why)."""

    action: str
    request_id: str
    prefill: str | None = None
    decode: str | None = None
    slo_class: str = ""
    ttft_objective_s: float | None = None
    tpot_objective_s: float | None = None
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    prefill_hit_blocks: int = 0
    decode_hit_blocks: int = 0
    load_only: bool = False
    reason: str = ""
    ttft_correction_s: float = 0.0  # the learned residual included in predicted_ttft_s
    waited_s: float = 0.0  # between arrival at the API and this decision
    tpot_scale: float = 1.0  # the TPOT scale included in predicted_tpot_s (Router.step_scale)
    predicted_wait_s: float | None = None  # queue: until it could be placed (router/wait_forecast.py)
    retry_after_s: float | None = None  # reject: when a fresh request could be placed in time (None: never)
    kv_source: str | None = None  # a local prefill first pulls the prompt's prefix from this peer's cache ...
    kv_source_blocks: int = 0  # ... until the decode worker holds this many leading blocks (router/peer_pull.py)


@dataclass
class _Placed:
    decision: Decision
    prompt_tokens: int
    placed_at: float
    max_tokens: int = 0
    displaced_ttft_s: float | None = None  # a re-measure: the predicted TTFT of the candidate it displaced


def _less_ended(load: WorkerLoad, ended: Sequence["_Ended"]) -> WorkerLoad:
    """``load`` less ``ended``, requests it counts that have ended since: each was in one of its
    states (running, else receiving, else waiting: which one the report does not say), and its
    blocks are free again. Right after a burst a report 0.1 s old showed the decode worker full
    of requests receiving or waiting that had all ended; counting them, the router refused a
    request on the idle cluster, predicting a long wait for a decode slot."""
    left = len(ended)
    states = {}
    for state in ("running", "receiving", "waiting"):
        states[state] = max(0, getattr(load, state) - left)
        left -= getattr(load, state) - states[state]
    blocks = sum(-(-e.context_tokens // max(1, load.block_size)) for e in ended)
    return replace(load, **states, next_slot_tokens=load.next_slot_tokens if states["running"] else 0,
                   free_blocks=min(load.num_blocks, load.free_blocks + blocks),
                   decode_context_tokens=max(0, load.decode_context_tokens - sum(e.context_tokens for e in ended)))


class _Ended(NamedTuple):
    """A placement that ended: its decode worker's reports from before ``ended_at`` may still
    count it (as running, with ``context_tokens`` of KV) if they show it (``WorkerLoad.shows``)."""

    placed_at: float
    ended_at: float
    context_tokens: int
    request_id: str


@dataclass
class RouterCounters:
    placed: int = 0
    local_prefills: int = 0
    queued: int = 0
    rejected: int = 0
    load_only: int = 0
    ttft_error_sum: float = 0.0  # |predicted - observed| / observed, summed
    ttft_error_n: int = 0
    last_rejection: str = ""
    waiting_placed: int = 0  # placed after having waited in the router
    remeasures: int = 0  # placed on the prefill path not chosen, to measure it (router/remeasure.py)
    rejected_by_class: dict[str, int] = field(default_factory=dict)


@dataclass
class Router:
    topology: Topology
    registry: RegistryView
    config: RouterConfig = field(default_factory=RouterConfig)
    probe_elsewhere: bool = False  # a registry found down is not read again until ``registry_answers``
    defer_refits: bool = False  # a changed report's model is refitted after the placement (``refit_deferred``)

    def __post_init__(self) -> None:
        self.inflight: dict[str, _Placed] = {}
        self.failed: set[str] = set()
        self._failed_incarnation: dict[str, str] = {}  # each failed worker's last reported incarnation
        self._failed_at: dict[str, float] = {}  # when each failed worker was found dead
        self.counters = RouterCounters()
        self._rotation = 0
        self._models: dict[str, tuple[tuple, StepTimeModel]] = {}
        self._refits: dict[str, WorkerLoad] = {}  # reports whose model is refitted after the placement
        self._loads: dict[str, WorkerLoad] = {}
        self._loads_read_at = -math.inf
        self._last_hits: dict[str, TierHits] | None = None
        self._changes = 0  # finished or forgotten placements, failed workers: reasons to offer the queue again
        self._gone: dict[str, float] = {}  # forgotten before they were placed (oldest first, bounded)
        self._offered_state: tuple | None = None
        self._registry_down_since: float | None = None
        self._registry_error = ""
        self._reported: set[str] = set()  # workers whose load report has ever been read
        self._last_seen: dict[str, tuple[WorkerLoad, float]] = {}  # each worker's last report, and when read
        self.waiting = WaitingQueue(self.config.queue_limit)
        self._residual = {"remote": (0.0, -math.inf), "local": (0.0, -math.inf)}  # (value, when last learned)
        self._output_tokens: float | None = None  # mean output length of finished requests (running)
        self._tpot_scale = (1.0, -math.inf)  # measured over predicted TPOT (running), and when last learned
        self._measured_scales: dict[str, tuple[tuple, float]] = {}  # per worker: its steps, their measured scale
        self.arriving = ArrivingClasses(self.config.class_headroom_window_s)
        self._class_tpot = {c.name: c.tpot_s for c in self.config.slo_classes}  # configured, not overridden
        self.warm_up_s: float | None = None  # how long its view took to rebuild from the registry (``warm_up``)
        self._ended: dict[str, list[_Ended]] = {}  # per decode worker: its placements ended since its last report
        self.remeasure = PathRemeasure()  # the prefill path not taken, measured again (router/remeasure.py)

    def correction(self, path: str, now: float) -> float:
        """The learned TTFT correction of a path (``remote`` or ``local`` prefill), decayed by
        the time since a finished request last refreshed it: towards the other path's when that
        one was refreshed since (never learned counts as before), else towards 0."""
        value, learned_at = self._residual[path]
        other, other_at = self._residual["local" if path == "remote" else "remote"]
        half_life = self.config.correction_half_life_s
        towards = other * 0.5 ** (max(0.0, now - other_at) / half_life) if other_at > learned_at else 0.0
        if learned_at == -math.inf:
            return towards
        return towards + (value - towards) * 0.5 ** (max(0.0, now - learned_at) / half_life)

    def tpot_scale(self, now: float) -> float:
        """Measured over predicted TPOT of finished requests (what a step-time fit misses when
        the machine's cores are contended, as an overload makes them), decaying towards 1 as
        ``correction`` does; predicted TPOTs are multiplied by it, and so a worker's batch is
        bounded by the TPOT objective over it."""
        value, learned_at = self._tpot_scale
        return 1.0 + (value - 1.0) * 0.5 ** (max(0.0, now - learned_at) / self.config.correction_half_life_s)

    def step_scale(self, load: WorkerLoad, now: float) -> float:
        """What the worker's predicted decode steps are multiplied by: the TPOT scale learned
        from finished requests, or where larger the one its latest steps measure
        (``measured_step_scale``), which an overload shows within a report rather than when
        the requests it slows end, a minute later."""
        cached = self._measured_scales.get(load.worker)
        if cached is None or cached[0] is not load.steps:
            cached = self._measured_scales[load.worker] = (load.steps, measured_step_scale(self.model(load), load.steps))
        return max(self.tpot_scale(now), min(cached[1], MEASURED_SCALE_LIMIT))

    @property
    def ttft_residual(self) -> dict[str, float]:
        """The corrections as last learned (not decayed)."""
        return {path: value for path, (value, _) in self._residual.items()}

    # -- the registry ---------------------------------------------------------------------

    def _read_loads(self, now: float, hashes: Sequence[bytes] | None = None) -> dict[str, WorkerLoad] | None:
        """Live workers' reports (refreshed at most every ``load_refresh_s``), or None while the
        registry is unreachable. A worker whose report lapsed (its heartbeat expired: a worker
        starved of CPU can miss a few) keeps its last report for ``REPORT_GRACE_S``: a worker
        is dead when the actor system says so (a call to it fails, and the caller tells the
        router; or its deployment, told by Ray, marks its report ``lost``), not when it is slow
        to report. With a prompt's block ``hashes``, a refresh looks up its prefix hits in the
        same round trip (into ``_last_hits``, every worker's)."""
        if self._registry_down_since is not None and (
                self.probe_elsewhere or now - self._registry_down_since < self.config.registry_retry_s):
            return None
        if now - self._loads_read_at >= self.config.load_refresh_s or self._registry_down_since is not None:
            try:
                if hashes is None:
                    fresh = self.registry.loads(self.topology.workers)
                else:
                    fresh, self._last_hits = self.registry.loads_and_prefix_tiers(self.topology.workers, hashes)
            except RegistryUnavailable as exc:
                self._mark_down(now, exc)
                return None
            for worker, load in list(fresh.items()):
                if load.lost:  # Ray found it dead: no grace, as for a call to it that failed
                    del fresh[worker]
                    self._last_seen.pop(worker, None)
                    if worker not in self.failed or self._failed_incarnation.get(worker) != load.incarnation:
                        self.worker_failed(worker, now)
                        self._failed_incarnation[worker] = load.incarnation
                    continue
                self._last_seen[worker] = (load, now)
                failed_as = self._failed_incarnation.get(worker) if worker in self.failed else None
                if failed_as and load.incarnation not in ("", failed_as):
                    self.worker_returned(worker)  # started again under its name (its deployment restarts the dead)
            self._loads = {w: load for w, (load, seen) in self._last_seen.items()
                           if w in fresh or now - seen <= REPORT_GRACE_S}
            self._loads_read_at = now
            self._reported.update(fresh)
            self._registry_down_since = None
        return self._loads

    def warm_up(self, now: float | None = None) -> float:
        """Rebuilds this router's view from the registry at once, as a router started again
        (its ingress replica restarted) does before its first placement: every worker's load
        report, and the step-time model fitted to it. The prefix index needs no rebuilding: it
        is the registry's, read per request. Returns the seconds it took (a metric)."""
        started = time.perf_counter()
        now = time.time() if now is None else now
        self._loads_read_at = -math.inf
        loads = self._read_loads(now)
        for load in (loads or {}).values():
            self.model(load)
        self.warm_up_s = time.perf_counter() - started
        return self.warm_up_s

    @property
    def registry_down(self) -> bool:
        return self._registry_down_since is not None

    def registry_answers(self) -> None:
        """The registry answers again (``probe_elsewhere``): the next placement reads it."""
        if self._registry_down_since is not None:
            self._registry_down_since = None
            self._loads_read_at = -math.inf
            self._changed()

    def _mark_down(self, now: float, exc: Exception) -> None:
        if self._registry_down_since is None:
            self._registry_down_since = now
        else:
            self._registry_down_since = max(self._registry_down_since, now - self.config.registry_retry_s)
        self._registry_error = str(exc)

    def model(self, load: WorkerLoad) -> StepTimeModel:
        """The worker's step-time model, refitted only when its reported steps changed. A phase
        the latest steps have no samples of (a decode worker's report after a run of decode
        steps holds no prefill) keeps its last fit rather than being predicted as free.

        With ``defer_refits`` (the ingress's router), a worker that has a model keeps it for this
        placement and is refitted by ``refit_deferred``, which its owner runs after the placement
        is answered: a placement after the workers' steps changed (every one at one stream, as
        each request's decode steps come in the next report) spent 0.9-1.2 ms refitting the two
        models of the quick start, of a 2.1-2.5 ms placement. The model it uses is then one
        report behind, at most ``load_refresh_s`` plus a report's period and the delay. The
        ingress waits ``REFIT_DELAY_S`` (``router/service.py``), past the request's first step,
        whose cores on the quick start the refit would share: one stream's TTFT p50 11.4 ms
        against 12.9 refitting at once (6 runs each, alternating). A model with no fit for a
        phase the new steps have samples of is refitted at once: deferred, a decode worker
        first fitted before it decoded was predicted to decode in no time, so with no rate at
        which its sequences end (CI: a request refused as waiting "with no end in sight" beside
        two running sequences)."""
        cached = self._models.get(load.worker)
        if cached is not None and self._refits.get(load.worker) is load:  # found changed earlier in this placement
            return cached[1]
        if cached is None or cached[0] is not load.steps:  # a report read since (steps compared once)
            if cached is not None and cached[0] == load.steps:
                fitted = cached[1]
            elif cached is not None and self.defer_refits and not cached[1].gap_filled_by(load.steps):
                self._refits[load.worker] = load
                return cached[1]
            else:
                fitted = self._refit(load, cached)
            cached = self._models[load.worker] = (load.steps, fitted)
        return cached[1]

    def _refit(self, load: WorkerLoad, cached: tuple[tuple, StepTimeModel] | None) -> StepTimeModel:
        fitted = StepTimeModel.fit(load.steps, load.max_num_batched_tokens)
        if cached is not None:
            fitted = replace(fitted, prefill=fitted.prefill or cached[1].prefill,
                             decode=fitted.decode or cached[1].decode)
        return fitted

    @property
    def refits_due(self) -> bool:
        return bool(self._refits)

    def refit_deferred(self) -> None:
        """Refits the models whose reports changed since they were fitted (``defer_refits``)."""
        refits, self._refits = self._refits, {}
        for worker, load in refits.items():
            cached = self._models.get(worker)
            if cached is not None and cached[0] is not load.steps and cached[0] != load.steps:
                self._models[worker] = (load.steps, self._refit(load, cached))

    # -- placing --------------------------------------------------------------------------

    def route(self, request: RouteRequest, now: float | None = None,
              hits: dict[str, TierHits] | None = None, ahead: tuple[int, int] | None = None) -> Decision:
        """One placement attempt: ``place``, ``queue`` (not held: see ``submit``) or ``reject``.
        ``hits`` are the prompt's prefix hits when the caller already has fresh ones; ``ahead``
        the requests (and their prompt tokens) waiting before it, when the caller counted them."""
        now = time.time() if now is None else now
        cls = self._class_of(request)
        self.arriving.saw(cls.name, self._class_tpot[cls.name], request.arrival if request.arrival is not None else now)
        hashes = None if hits is not None else self._block_hashes(request)
        self._last_hits = None
        loads = self._read_loads(now, hashes)
        if loads is not None and hits is None:
            if self._last_hits is None:  # the reports were fresh enough: the hits alone
                hits = self._prefix_hits(hashes, sorted(loads), now)
            else:
                hits = self._last_hits = {w: self._last_hits.get(w, TierHits(0)) for w in sorted(loads)}
        if loads is None or hits is None:
            return self._place_by_load(request, cls, now)
        loads = self._net_of_ended(loads)
        topology = self.topology
        live = LivePools.of(topology.prefill, topology.decode, topology.colocated, loads, self.failed, topology.draining)
        if not live.generating:
            return self._without_reports(request, cls, "decode", now)
        candidates = self._candidates(request, cls, loads, hits, live, now)
        if not candidates:  # no live prefill worker, and no decode worker may prefill this prompt itself
            return self._without_reports(request, cls, "prefill", now)
        forecast = lambda best: self._forecast(request, cls, loads, live, best, ahead, now)  # noqa: E731
        return self._choose(request, cls, candidates, now, forecast)

    def submit(self, request: RouteRequest, now: float | None = None) -> Decision:
        """``route``, holding a request that must wait: it is answered by a later
        ``retry_waiting`` (or dropped by ``cancel``). A full queue rejects instead. A request
        already forgotten (its caller left, and the word came before the request itself: an
        asyncio actor runs calls out of order) is not placed."""
        now = time.time() if now is None else now
        if self._gone.pop(request.request_id, None) is not None:
            return Decision("reject", request.request_id, slo_class=self._class_of(request).name,
                            reason="its caller went away before it was placed")
        decision = self.route(request, now)
        if decision.action != "queue":
            return decision
        if request.request_id in self.waiting:
            return decision
        if self.waiting.full():
            reason = (f"the router already holds {self.config.queue_limit} waiting requests (router.queue_limit); "
                      + decision.reason)
            return self._reject(request, self._class_of(request), reason, now,
                                retry_after_s=decision.retry_after_s)
        self.waiting.add(request, request.priority + self._class_of(request).priority,
                         request.arrival if request.arrival is not None else now, self._last_hits, now)
        return decision

    def retry_waiting(self, now: float | None = None) -> list[Decision]:
        """Offers every waiting request again, in priority order, each on its own; returns
        those it placed or rejected (the rest keep waiting).

        Two things keep a long queue cheap. Nothing is offered again unless something changed
        since the last offer (a newer load report, a request finished or was forgotten). And
        within one offer, a request that must wait tells about the ones behind it: another of
        the same objectives with at least as many tokens to prefill and as long a prompt would
        be predicted no faster, so it waits too without being routed.

        A request past its class's wait bound is refused whether or not anything changed."""
        now = time.time() if now is None else now
        resolved = self._expired(now)
        loads = self._read_loads(now)
        state = (max((l.updated_at for l in loads.values()), default=None) if loads is not None else now,
                 self._changes)
        if state == self._offered_state:
            return resolved
        self._offered_state = state
        must_wait = []
        ahead, ahead_tokens = 0, 0
        for entry in self.waiting.in_order():
            request = entry.request
            size = (self._uncached_tokens(request, entry.hits), len(request.prompt_token_ids))
            kind = (request.slo_class, request.ttft_s, request.tpot_s)
            if any(k == kind and size[0] >= u and size[1] >= n for k, u, n in must_wait):
                ahead, ahead_tokens = ahead + 1, ahead_tokens + size[1]
                continue
            fresh = entry.hits if now - entry.hits_at < HITS_TTL_S else None
            decision = self.route(request, now, hits=fresh, ahead=(ahead, ahead_tokens))
            if fresh is None and self._last_hits is not None:
                entry.hits, entry.hits_at = self._last_hits, now
            if decision.action == "queue":
                must_wait.append((kind, *size))
                ahead, ahead_tokens = ahead + 1, ahead_tokens + size[1]
                continue
            self.waiting.remove(request.request_id)
            self.counters.waiting_placed += decision.action == "place"
            resolved.append(decision)
        return resolved

    def _expired(self, now: float) -> list[Decision]:
        """The waiting requests held past their class's wait bound, routed once more: placed if
        they can be now, else refused with a fresh forecast of when one could be."""
        out = []
        for entry in self.waiting.in_order():
            request = entry.request
            cls = self._class_of(request)
            bound = cls.wait_bound_s
            if bound is None or _waited(request, now) <= bound:
                continue
            self.waiting.remove(request.request_id)
            decision = self.route(request, now)
            if decision.action == "queue":  # no load report to judge by
                why = (f"slo_class {cls.name!r} waited {_waited(request, now) * 1000:.0f} ms for a placement, past "
                       f"its bound of {bound * 1000:.0f} ms (router.slo_classes.{cls.name}.max_wait_ms): {decision.reason}")
                decision = self._reject(request, cls, why, now, retry_after_s=decision.retry_after_s)
            self.counters.waiting_placed += decision.action == "place"
            out.append(decision)
        return out

    def _uncached_tokens(self, request: RouteRequest, hits: dict[str, TierHits] | None) -> int:
        best = max((h.blocks for h in hits.values()), default=0) if hits else 0
        return len(request.prompt_token_ids) - best * self.topology.block_size

    def cancel(self, request_id: str) -> bool:
        """Drops a waiting request (its caller went away); True if it was waiting."""
        return self.waiting.remove(request_id) is not None

    def _changed(self) -> None:
        """Something that could let a waiting request be placed: offer the queue again."""
        self._changes += 1

    def _class_of(self, request: RouteRequest) -> SloClass:
        cls = self.config.slo_class(request.slo_class)
        if request.ttft_s is not None or request.tpot_s is not None:
            cls = replace(cls, ttft_s=request.ttft_s if request.ttft_s is not None else cls.ttft_s,
                          tpot_s=request.tpot_s if request.tpot_s is not None else cls.tpot_s)
        if request.admitted and cls.on_overload != "admit":
            cls = replace(cls, on_overload="admit")
        return cls

    def _without_reports(self, request: RouteRequest, cls: SloClass, side: str, now: float) -> Decision:
        """No live worker of one role in the registry: if one has not reported yet (starting),
        the request waits for its first report (placing it blind would skip admission);
        if every one has reported before and is gone or failed, nothing can serve it."""
        names = self.topology.prefill if side == "prefill" else self.topology.decode + self.topology.colocated
        starting = [w for w in names if w not in self._reported and w not in self.failed]
        returning = [w for w in names if self._restarting(w, now)]
        if starting or returning:
            reason = (f"waiting for the first load report of {starting[0]}" if starting else
                      f"waiting for {returning[0]} to start again")
            self.counters.queued += 1
            return Decision("queue", request.request_id, slo_class=cls.name, ttft_objective_s=cls.ttft_s,
                            tpot_objective_s=cls.tpot_s, reason=reason, waited_s=_waited(request, now))
        self.counters.rejected += 1
        return Decision("reject", request.request_id, slo_class=cls.name, reason=f"no live {side} worker",
                        waited_s=_waited(request, now))

    def _restarting(self, worker: str, now: float) -> bool:
        """Whether ``worker``, reported once and dead or silent now, is expected back: its
        deployment restarts dead workers, and it went less than ``RESTART_WAIT_S`` ago (a
        request waits for it, within its class's bound, rather than failing at once)."""
        if not self.topology.restarts_workers or worker not in self._reported:
            return False
        if worker in (self._loads or {}) and worker not in self.failed:
            return False  # alive: what it lacks (a pair, say) is not a restart
        seen = self._last_seen.get(worker)
        gone_at = max(self._failed_at.get(worker, -math.inf), seen[1] if seen else -math.inf)
        return now - gone_at < RESTART_WAIT_S

    def _block_hashes(self, request: RouteRequest) -> list[bytes]:
        keys = request_hash_keys(self.topology.hash_keys, request.cache_salt)
        return hash_token_blocks(request.prompt_token_ids, self.topology.block_size, keys)

    def _prefix_hits(self, hashes: Sequence[bytes], live: Sequence[str], now: float) -> dict[str, TierHits] | None:
        self._last_hits = None
        try:
            self._last_hits = self.registry.prefix_tiers(hashes, live)
        except RegistryUnavailable as exc:
            self._mark_down(now, exc)
        return self._last_hits

    def _net_of_ended(self, loads: dict[str, WorkerLoad]) -> dict[str, WorkerLoad]:
        """The reports less the requests they count that have ended since (as this router was
        told): what each decode worker runs now, not when it last reported (every 0.1 s)."""
        if not self._ended:
            return loads
        out = dict(loads)
        for worker, ended in list(self._ended.items()):
            load = loads.get(worker)
            if load is None:
                continue
            ended = [e for e in ended if e.ended_at >= load.updated_at]  # the rest, its report shows ended
            if not ended:
                self._ended.pop(worker)
                continue
            self._ended[worker] = ended
            counted = [e for e in ended if load.shows(e.request_id, e.placed_at)]
            if counted:
                out[worker] = _less_ended(load, counted)
        return out

    def _pending(self, loads: dict[str, WorkerLoad], workers: Sequence[str]) -> dict[str, list[_Placed]]:
        """For each worker, the placements on it that its last report does not show (``WorkerLoad.shows``)."""
        pending: dict[str, list[_Placed]] = {w: [] for w in workers}
        for placed in self.inflight.values():
            for w in {placed.decision.prefill, placed.decision.decode}:
                if w in pending and not loads[w].shows(placed.decision.request_id, placed.placed_at):
                    pending[w].append(placed)
        return pending

    def _queued_prefill_tokens(self, worker: str, load: WorkerLoad, pending: list[_Placed]) -> int:
        """Prompt tokens waiting to be prefilled on ``worker``: as it reported, plus those of the
        placements since that it prefills (its own, or a local prefill)."""
        since = sum(p.prompt_tokens for p in pending if p.decision.prefill in (worker, None))
        return load.queued_prefill_tokens + since

    def _candidates(self, request: RouteRequest, cls: SloClass, loads: dict[str, WorkerLoad],
                    hits: dict[str, TierHits], live: LivePools, now: float) -> list[Candidate]:
        """Every (prefill, decode) pair that passes the filters, and every worker that may
        prefill the prompt itself (``prefills_itself``), with their predictions."""
        prompt = Prompt.of(len(request.prompt_token_ids), request.max_tokens, self.topology.block_size)
        pending_on = self._pending(loads, live.everyone)
        queued = {w: self._queued_prefill_tokens(w, loads[w], pending_on[w]) for w in live.everyone}
        prefill_sides = {p: prefill_side(self.model(loads[p]), queued[p], prompt.hit_blocks(hits, p), prompt)
                         for p in live.prefill}
        remote_correction, local_correction = self.correction("remote", now), self.correction("local", now)
        generating = live.generating
        turn_p = live.prefill[self._rotation % len(live.prefill)] if live.prefill else None
        turn_d = generating[self._rotation % len(generating)]
        shortlist = soonest_prefill(live.prefill, prefill_sides, self.config.prefill_shortlist, turn_p)
        limits = self.tpot_limits(cls, generating, now)
        candidates = []
        for d in generating:
            side = decode_side(loads[d], self.model(loads[d]), [p.prompt_tokens for p in pending_on[d]],
                               prompt.hit_blocks(hits, d), prompt, cls.on_overload)
            scale = self.step_scale(loads[d], now)
            side = side._replace(tpot_s=side.tpot_s * scale)
            first = len(candidates)
            is_decode = d in live.decode
            cut = cut_off(d, loads[d], request.avoid, prefill_sides) if is_decode else set()
            paired = (paired_prefill(shortlist, live.prefill, cut, prefill_sides, self.config.prefill_shortlist)
                      if is_decode else [])
            every_pair_cut_off = is_decode and bool(live.prefill) and len(cut) == len(live.prefill)  # being rebuilt
            # A draining peer is still pulled from: it caches what it served until it is removed.
            peers = [q for q in loads[d].pull_from if q in loads and q not in self.failed and q != d]
            pull = (best_pull(side.model, side.hit_blocks, peers, hits, {q: self.model(loads[q]) for q in peers},
                              prompt, loads[d].pull_s_per_block) if peers else None)
            held = pull.blocks if pull is not None else side.hit_blocks.blocks
            local = prefills_itself(colocated=d in live.colocated, hit_blocks=held,
                                    cacheable_blocks=prompt.cacheable_blocks,
                                    uncached_tokens=prompt.uncached_tokens(held),
                                    every_pair_cut_off=every_pair_cut_off, config=self.config)
            if local:
                paired = on_cores_of_their_own(paired, loads, d)
            candidates += remote_candidates(d, side, paired, prefill_sides, queued, prompt, remote_correction,
                                            rotation_prefill=turn_p if d == turn_d else None)
            if local:
                local_turn = d == turn_d and (turn_p is None or d in live.colocated)
                candidates.append(local_candidate(d, side, queued[d], prompt, local_correction, local_turn, pull))
            kept = limits[d] if limits[d] != cls.tpot_s else None
            for c in candidates[first:]:
                c.tpot_scale, c.tpot_limit_s = scale, kept
        return candidates

    def _choose(self, request: RouteRequest, cls: SloClass, candidates: list[Candidate], now: float,
                forecast: Callable[[Candidate], WaitForecast]) -> Decision:
        """The picker's choice as a decision: the best ranked, or under admission control the
        best that meets the objectives counting the time the request already spent; else the
        class's ``on_overload`` says what happens. A request that may wait is held only while
        its predicted wait (``forecast``) keeps within its class's bound and its first token
        within its objective; otherwise it is refused now, not after waiting for nothing."""
        ranked = rank(candidates, self.config.weights, cls)
        if not self.config.admission_control:
            return self._place(request, cls, ranked[0], now)
        spent = _waited(request, now)
        if cls.ttft_s is None and cls.tpot_s is None:
            chosen = without_room(first_within_headroom(ranked), ranked)
            if chosen is None:
                return self._hold_for_room(request, cls, fastest(ranked), spent, forecast)
            return self._place_or_remeasure(request, cls, chosen, ranked, now, room_within_headroom)
        chosen = first_meeting(ranked, cls, spent)
        if chosen is not None:
            return self._place_or_remeasure(request, cls, chosen, ranked, now,
                                            lambda c: serves_in_time(c, cls, spent))
        best = fastest(ranked)
        if cls.on_overload == "admit" or (cls.on_overload == "queue" and never_meets(candidates, cls, 0.0)):
            @cache
            def why() -> str:  # once, and not for a request held for room (offered again on every change)
                never = never_meets(candidates, cls, 0.0 if cls.on_overload == "queue" else spent)
                return explain(cls, best, never, spent, full=not with_room(candidates))

            chosen = without_room(ranked[0], ranked)
            waits = chosen is None or (not chosen.decode_has_room and chosen.decode_room_later)  # here, or in a queue
            if waits and cls.on_overload == "queue":  # within its class's bound only
                refused = self._past_wait_bound(request, cls, best, forecast(best), spent, why(), now)
                if refused is not None:
                    return refused
            if chosen is None:
                return self._hold_for_room(request, cls, best, spent, forecast)
            return self._place(request, cls, chosen, now, reason="best effort: " + why())
        never = never_meets(candidates, cls, spent)
        why = explain(cls, best, never, spent, full=not with_room(candidates))
        wait = forecast(best)
        if cls.on_overload == "reject":
            return self._reject(request, cls, why, now, best, _retry_after(wait, cls))
        refused = self._past_wait_bound(request, cls, best, wait, spent, why, now)
        if refused is not None:
            return refused
        retry_after = _retry_after(wait, cls)
        if never or (cls.ttft_s is not None and wait.first_token_s(spent) > cls.ttft_s):
            return self._reject(request, cls, f"its first token is predicted "
                                f"{wait.first_token_s(spent) * 1000:.0f} ms after arrival however long it waits "
                                f"(backlog {wait.backlog_s * 1000:.0f} ms, slot in {wait.wait_s * 1000:.0f} ms); "
                                + why, now, best, retry_after)
        self.counters.queued += 1
        return Decision("queue", request.request_id, slo_class=cls.name, ttft_objective_s=cls.ttft_s,
                        tpot_objective_s=cls.tpot_s, predicted_ttft_s=best.ttft_s,
                        predicted_tpot_s=best.tpot_s, reason=why, waited_s=spent,
                        predicted_wait_s=wait.wait_s, retry_after_s=retry_after)

    def _past_wait_bound(self, request: RouteRequest, cls: SloClass, best: Candidate, wait: WaitForecast,
                         spent: float, why: str, now: float) -> Decision | None:
        """The refusal of a request predicted to wait for a decode slot past its class's bound
        (``SloClass.wait_bound_s``); None when it may wait. Even one whose objective no idle pair
        meets (placed best effort where there is room) waits no longer: one with a 300 ms bound
        went into a full decode worker's queue, thousands of steps from a free slot."""
        bound = cls.wait_bound_s
        if bound is None or spent + wait.wait_s <= bound:
            return None
        more = (f"{wait.wait_s * 1000:.0f} ms more" if math.isfinite(wait.wait_s) else
                "with no end in sight (no sequence decoding at a measured pace to free one)")
        return self._reject(request, cls, f"predicted to wait {more} for a decode slot (after {spent * 1000:.0f} "
                            f"ms), past its bound of {bound * 1000:.0f} ms; " + why, now, best, _retry_after(wait, cls))

    def _hold_for_room(self, request: RouteRequest, cls: SloClass, best: Candidate, spent: float,
                       forecast: Callable[[Candidate], WaitForecast]) -> Decision:
        """A best-effort request (never refused by its class) that no decode worker has room for
        now: held until a request ends and frees some (``retry_waiting``). Placed without room, a
        remote prefill's reservation failed at the decode worker over and over: under a
        benchmark's KV pressure, requests gave up after 4 placements of 50 tries each."""
        wait = forecast(best)
        self.counters.queued += 1
        return Decision("queue", request.request_id, slo_class=cls.name, ttft_objective_s=cls.ttft_s,
                        tpot_objective_s=cls.tpot_s, predicted_ttft_s=best.ttft_s, predicted_tpot_s=best.tpot_s,
                        reason="no decode worker has a free slot and KV blocks now; held until one frees some",
                        waited_s=spent, predicted_wait_s=wait.wait_s,
                        retry_after_s=wait.retry_after_s(cls.ttft_s) if math.isfinite(wait.wait_s) else None)

    def _forecast(self, request: RouteRequest, cls: SloClass, loads: dict[str, WorkerLoad], live: LivePools,
                  best: Candidate, ahead: tuple[int, int] | None, now: float) -> WaitForecast:
        """When the request could be placed (``router/wait_forecast.py``), behind the requests
        waiting ahead of it (``ahead``: counted here when the caller did not)."""
        if ahead is None:
            arrival = request.arrival if request.arrival is not None else now
            ahead = self.waiting.ahead_of(request.priority + cls.priority, arrival)
        ahead_requests, ahead_tokens = ahead
        bs = self.topology.block_size
        per_request = -(-(len(request.prompt_token_ids) + request.max_tokens) // bs)
        output_tokens = self._mean_output_tokens(request)
        pending_on = self._pending(loads, live.generating)
        limits = self.tpot_limits(cls, live.generating, now)
        slots = [decode_slots(loads[d], self.model(loads[d]), [p.prompt_tokens for p in pending_on[d]], per_request,
                              limits[d], output_tokens, max(0.0, now - loads[d].updated_at),
                              self.step_scale(loads[d], now))
                 for d in live.generating]
        side = best.prefill or best.decode
        prefill_workers = max(1, len(live.prefill)) if best.prefill else 1
        share = -(-ahead_tokens // prefill_workers)  # the prompts ahead are spread over the prefill pool
        backlog = best.queue_s + self.model(loads[side]).queue_seconds(share)
        return WaitForecast(slot_wait_s(slots, ahead_requests + 1), backlog, best.idle_ttft_s)

    def tpot_limits(self, cls: SloClass, workers: Sequence[str], now: float) -> dict[str, float | None]:
        """For each of ``workers``, the highest predicted TPOT a request of ``cls`` may bring it to
        (``router/class_headroom.py``): its objective, or less where a class with a tighter one
        runs there (among this router's placements) or arrived within the window."""
        arriving = self.arriving.objectives(now)
        running: dict[str, set[float]] = {w: set() for w in workers}
        for placed in self.inflight.values():
            tpot = self._class_tpot.get(placed.decision.slo_class)
            if tpot is not None and placed.decision.decode in running:
                running[placed.decision.decode].add(tpot)
        headroom = self.config.class_headroom
        return {w: tpot_limit(cls.tpot_s, (*arriving, *running[w]), headroom) for w in workers}

    def _mean_output_tokens(self, request: RouteRequest) -> float:
        """The output length of an average request: learned from finished ones, else the mean
        planned ``max_tokens`` of those in flight, else this request's."""
        if self._output_tokens is not None:
            return self._output_tokens
        if self.inflight:
            return sum(p.max_tokens for p in self.inflight.values()) / len(self.inflight)
        return float(max(1, request.max_tokens))

    def _reject(self, request: RouteRequest, cls: SloClass, why: str, now: float,
                fastest: Candidate | None = None, retry_after_s: float | None = None) -> Decision:
        self.counters.rejected += 1
        self.counters.rejected_by_class[cls.name] = self.counters.rejected_by_class.get(cls.name, 0) + 1
        self.counters.last_rejection = why
        return Decision("reject", request.request_id, slo_class=cls.name, ttft_objective_s=cls.ttft_s,
                        tpot_objective_s=cls.tpot_s, predicted_ttft_s=fastest.ttft_s if fastest else None,
                        predicted_tpot_s=fastest.tpot_s if fastest else None, reason=why,
                        waited_s=_waited(request, now), retry_after_s=retry_after_s)

    def _place_or_remeasure(self, request: RouteRequest, cls: SloClass, chosen: Candidate,
                            ranked: Sequence[Candidate], now: float, serves: Callable[[Candidate], bool]) -> Decision:
        """``chosen``, unless the prefill path it does not take is due a re-measure and the best
        candidate of that path ``serves`` the request as well (``router/remeasure.py``)."""
        alt = self.remeasure.pick(chosen, ranked, serves)
        if alt is None:
            return self._place(request, cls, chosen, now)
        why = "measured sooner last time" if path_of(alt) in self.remeasure.faster else "not taken for a while"
        reason = (f"re-measuring the {path_of(alt)} prefill path ({why}): {alt.label} predicts TTFT "
                  f"{alt.ttft_s * 1000:.0f} ms against {chosen.ttft_s * 1000:.0f} ms for {chosen.label}")
        decision = self._place(request, cls, alt, now, reason)
        self.counters.remeasures += 1
        self.inflight[request.request_id].displaced_ttft_s = chosen.ttft_s
        return decision

    def _place(self, request: RouteRequest, cls: SloClass, c: Candidate, now: float, reason: str = "") -> Decision:
        self._rotation += 1
        self.counters.placed += 1
        self.counters.local_prefills += c.prefill is None
        self.remeasure.placed(c)
        decision = Decision("place", request.request_id, c.prefill, c.decode, cls.name, cls.ttft_s, cls.tpot_s,
                            c.ttft_s, c.tpot_s, c.prefill_hit_blocks, c.decode_hit_blocks, reason=reason,
                            ttft_correction_s=c.correction_s, waited_s=_waited(request, now),
                            tpot_scale=c.tpot_scale, kv_source=c.kv_source, kv_source_blocks=c.kv_source_blocks)
        self.inflight[request.request_id] = _Placed(decision, len(request.prompt_token_ids), now, request.max_tokens)
        return decision

    def _place_by_load(self, request: RouteRequest, cls: SloClass, now: float) -> Decision:
        """No registry: the live workers with the fewest of this router's requests in flight."""
        def least_busy(names: Sequence[str], side: str) -> str | None:
            alive = [w for w in names if w not in self.failed and w not in self.topology.draining]
            if not alive:
                return None
            count = {w: 0 for w in alive}
            for p in self.inflight.values():
                w = getattr(p.decision, side)
                if w in count:
                    count[w] += 1
            return min(alive, key=lambda w: count[w])

        p, d = least_busy(self.topology.prefill, "prefill"), least_busy(self.topology.decode, "decode")
        if p is None or d is None:
            side = "prefill" if p is None else "decode"
            self.counters.rejected += 1
            return Decision("reject", request.request_id, slo_class=cls.name, reason=f"no live {side} worker",
                            waited_s=_waited(request, now))
        self.counters.placed += 1
        self.counters.load_only += 1
        decision = Decision("place", request.request_id, p, d, cls.name, cls.ttft_s, cls.tpot_s, load_only=True,
                            reason="registry unreachable: placed by load only", waited_s=_waited(request, now))
        self.inflight[request.request_id] = _Placed(decision, len(request.prompt_token_ids), now, request.max_tokens)
        return decision

    # -- what happened afterwards ---------------------------------------------------------

    def forget(self, request_id: str) -> Decision | None:
        """The request was not started after all (its decode worker had no room, its caller
        went away). Forgetting one not placed yet keeps it from being placed later."""
        placed = self.inflight.pop(request_id, None)
        if placed is None:
            if not self.waiting.remove(request_id):
                self._gone[request_id] = time.time()
                while len(self._gone) > GONE_KEPT:
                    self._gone.pop(next(iter(self._gone)))
            return None
        self._changed()
        return placed.decision

    def finished(self, request_id: str, service_ttft_s: float | None = None,
                 now: float | None = None, output_tokens: int | None = None,
                 tpot_s: float | None = None) -> Decision | None:
        """A placed request ended. ``service_ttft_s`` is its TTFT counted from when it was
        placed (dispatch), not from arrival: its own wait for placement is not work the
        step-time model left out, and learning it would make an idle cluster look slow.
        ``output_tokens``: what it generated, for the mean output length the wait forecast uses;
        ``tpot_s``: its measured TPOT, for the TPOT scale."""
        placed = self.inflight.pop(request_id, None)
        if placed is None:
            return None
        self._changed()
        decision = placed.decision
        if decision.decode is not None and not decision.load_only:
            ended_at = time.time() if now is None else now
            ended = self._ended.setdefault(decision.decode, [])
            ended.append(_Ended(placed.placed_at, ended_at, placed.prompt_tokens + (output_tokens or 0), request_id))
            del ended[:-ENDED_KEPT]
        if output_tokens:
            mean = self._output_tokens
            self._output_tokens = float(output_tokens) if mean is None else mean + OUTPUT_WEIGHT * (output_tokens - mean)
        predicted = decision.predicted_ttft_s
        if service_ttft_s and predicted is not None and not decision.load_only:
            now = time.time() if now is None else now
            self.counters.ttft_error_sum += abs(predicted - service_ttft_s) / service_ttft_s
            self.counters.ttft_error_n += 1
            path = "local" if decision.prefill is None else "remote"
            limit = self.config.correction_limit_s
            residual = min(limit, max(-limit, service_ttft_s - (predicted - decision.ttft_correction_s)))
            current = self.correction(path, now)
            self._residual[path] = (current + RESIDUAL_WEIGHT * (residual - current), now)
            if placed.displaced_ttft_s is not None:
                self.remeasure.measured(path, service_ttft_s, placed.displaced_ttft_s)
        if tpot_s and decision.predicted_tpot_s and not decision.load_only:
            now = time.time() if now is None else now
            low, high = TPOT_SCALE_LIMITS
            ratio = min(high, max(low, tpot_s / (decision.predicted_tpot_s / decision.tpot_scale)))
            current = self.tpot_scale(now)
            self._tpot_scale = (current + RESIDUAL_WEIGHT * (ratio - current), now)
        return decision

    def set_membership(self, membership: Membership) -> bool:
        """Places by the deployment's newer ``membership`` (workers added, draining, removed);
        False if it is not newer than the one in use. Requests waiting are offered again: an
        added worker may take them."""
        if membership.version <= self.topology.version:
            return False
        self.topology = self.topology.with_membership(membership)
        named = set(self.topology.workers)
        for gone in [w for w in self._last_seen if w not in named]:  # removed: nothing of theirs is kept
            self._last_seen.pop(gone)
            self._models.pop(gone, None)
            self._measured_scales.pop(gone, None)
            self._loads.pop(gone, None)
            self._ended.pop(gone, None)
        self._loads_read_at = -math.inf  # the next placement reads the added workers' reports
        self._changed()
        return True

    def incarnation(self, worker: str) -> str:
        """The incarnation of ``worker`` in its latest report read ("" before any): another one
        is the worker started again under its name."""
        seen = self._last_seen.get(worker)
        return seen[0].incarnation if seen else ""

    def worker_failed(self, worker: str, now: float | None = None) -> None:
        """A call to ``worker`` failed: no placement goes to it until it returns, told by
        ``worker_returned`` or seen in a report of another incarnation (started again)."""
        self.failed.add(worker)
        seen = self._last_seen.get(worker)
        self._failed_incarnation[worker] = seen[0].incarnation if seen else ""
        self._failed_at[worker] = time.time() if now is None else now
        self._changed()

    def worker_returned(self, worker: str) -> None:
        if worker in self.failed:
            self.failed.discard(worker)
            self._failed_incarnation.pop(worker, None)
            self._failed_at.pop(worker, None)
            self._changed()

    def status(self, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        c = self.counters
        if self._registry_down_since is not None:
            registry = (f"unreachable for {now - self._registry_down_since:.1f}s ({self._registry_error}); "
                        "placing by load only")
        else:
            registry = "ok"
        return {
            "policy": self.config.policy, "weights": dict(self.config.weights), "registry": registry,
            "workers": list(self.topology.workers), "topology_version": self.topology.version,
            "draining_workers": list(self.topology.draining),
            "live_workers": sorted(self._loads) if self._registry_down_since is None else [],
            "failed_workers": sorted(self.failed), "in_flight": len(self.inflight),
            "placed": c.placed, "local_prefills": c.local_prefills, "prefill_path_remeasures": c.remeasures,
            "queued_decisions": c.queued,
            "waiting": len(self.waiting), "waiting_by_class": self.waiting.by_class(),
            "placed_after_waiting": c.waiting_placed,
            "rejected": c.rejected, "rejected_by_class": dict(c.rejected_by_class),
            "mean_output_tokens": self._output_tokens, "tpot_scale": self.tpot_scale(now),
            "measured_step_scales": {w: scale for w, (_, scale) in sorted(self._measured_scales.items())},
            "arriving_classes": self.arriving.names(now),
            "placed_by_load_only": c.load_only, "last_rejection": c.last_rejection,
            "ttft_prediction_error": c.ttft_error_sum / c.ttft_error_n if c.ttft_error_n else None,
            "ttft_correction_s": {path: self.correction(path, now) for path in self._residual},
            "warm_up_s": self.warm_up_s,
        }


def _waited(request: RouteRequest, now: float) -> float:
    return max(0.0, now - request.arrival) if request.arrival is not None else 0.0


def _retry_after(wait: WaitForecast, cls: SloClass) -> float | None:
    """When a refused request could come back: when a fresh one could be placed in time, or where
    nothing decodes at a measured pace and nothing has room (no rate to go by), its class's bound."""
    retry_after = wait.retry_after_s(cls.ttft_s)
    return retry_after if math.isfinite(retry_after) else cls.wait_bound_s
