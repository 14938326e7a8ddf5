"""A discrete-event simulator of a Tandem cluster, built from the cluster's own parts.

What is the same code as the real cluster, not a copy:

- placement and admission: ``router.router.Router`` (policies, scorers, SLO classes, the
  waiting queue, the learned TTFT correction), reading a simulated registry;
- each worker's scheduling: the engine's ``Scheduler`` and ``BlockManager`` (token budget
  per step, ``max_num_seqs``, chunked prefill, preemption, the prefix cache by
  ``cluster.engine.block_hash``), driven by a stand-in engine whose steps take the time a
  ``router.cost_model.StepTimeModel`` predicts instead of running a model;
- the start-up profile (``step_profile.measure``) and the load reports the router reads
  (``EngineWorker._snapshot_held``), run on the simulated workers;
- the workload, arrivals and metrics of ``tandem bench`` (``cluster/bench``).

What is modelled: each request follows the real request path (``cluster/ingress/request_path.py``,
``decode_worker/worker.py``): the call reaches the ingress (a message) and its own router
places it there (in the process: no message), then the decode
worker either prefills the prompt itself (no prefill worker: conditional disaggregation, or a
colocated worker) or reserves blocks, asks the chosen prefill worker for the missing KV
(which pays the KV transfer's tail, ``transfer_s_per_block`` per block sent, in the step that
finishes the prompt), and admits the request with the first token; a decode worker with no
free blocks sends the request back to be placed again. A call into a worker waits for the
step in progress (the workers' ``StepLock``). Every control-plane message costs ``hop_s``.
Workers report their load every ``REPORT_INTERVAL_S``; the router's prefix lookups see each
worker's cache as it is (the real registry lags by up to one report).

What is not: step-time noise, CPU contention beyond what the fitted step times hold, Redis
and gRPC costs beyond ``hop_s``, failures and migration.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import math
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable

from cluster.bench.arrivals import Arrivals
from cluster.bench.metrics import Objectives, RequestResult, span_s
from cluster.bench.runner import answer_tokens, session_start_offsets
from cluster.bench.workloads import FIRST_TOKEN_ID, Session, Workload
from cluster.engine.block_manager import BlockManager
from cluster.engine.engine import EngineStats, StepRecord
from cluster.engine.request import Request
from cluster.engine.sampling_params import InvalidRequestError, SamplingParams
from cluster.engine.scheduler import Scheduler, SchedulerOutput
from cluster.plan.shared_cores import SharedCores
from cluster.runtime.cpu_cores import NO_CORES, compute_cores_of
from cluster.worker import step_profile
from cluster.worker.arrivals import RecentArrivals
from cluster.worker.engine_worker import EngineWorker
from cluster.registry.kv_index import TierHits
from cluster.registry.load import WorkerLoad
from cluster.registry.reporter import WorkerReporter
from cluster.runtime.ray_node import NodePlace
from cluster.ingress.request_path import NO_ROOM_RETRIES
from router.config import RouterConfig
from router.cost_model import StepTimeModel
from router.router import Decision, RouteRequest, Router, Topology

REPORT_INTERVAL_S = inspect.signature(WorkerReporter.__init__).parameters["interval_s"].default
HASH_KEYS = ("simulated", "model")
EPOCH = 1000.0  # the simulated wall clock at the run's start
DRAIN_LIMIT_S = 600.0  # after the last arrival, how long requests in flight may take before they count as failed


@dataclass(frozen=True)
class WorkerSpec:
    """One worker's shape: its step times and its engine's limits."""

    model: StepTimeModel
    num_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 4096
    prefix_caching: bool = True
    chunked_prefill: bool = True
    tp: int = 1
    threads: int = 1  # CPU threads a step keeps busy (each rank's); counts only with ``SimConfig.shared_cores``


@dataclass(frozen=True)
class Pools:
    """The workers of a simulated cluster: replicas and shape per role."""

    prefill: tuple[int, WorkerSpec | None] = (0, None)
    decode: tuple[int, WorkerSpec | None] = (0, None)
    colocated: tuple[int, WorkerSpec | None] = (0, None)

    def workers(self) -> list[tuple[str, str, WorkerSpec]]:
        return [(f"{role}-{i}", role, spec) for role in ("prefill", "decode", "colocated")
                for replicas, spec in [getattr(self, role)] for i in range(replicas)]

    def ranks(self) -> int:
        return sum(replicas * spec.tp for replicas, spec in (self.prefill, self.decode, self.colocated) if replicas)

    def label(self) -> str:
        parts = []
        for role, letter in (("prefill", "P"), ("decode", "D"), ("colocated", "C")):
            replicas, spec = getattr(self, role)
            if replicas:
                parts.append(f"{replicas}{letter}" + (f"(TP{spec.tp})" if spec.tp > 1 else ""))
        return "+".join(parts)


@dataclass(frozen=True)
class SimConfig:
    router: RouterConfig = field(default_factory=RouterConfig)
    hop_s: float = 0.0  # one control-plane message (ingress-router, ingress-worker, worker-worker, a token's way back)
    duration_s: float | None = None  # as ``tandem bench --duration``: nothing is sent after it
    send_objectives: Objectives | None = None  # sent with every request, as ``tandem bench --send-objectives``
    # CPU cores every worker shares (CPU workers on one machine); None: each worker has its own device.
    # While the steps in progress want more threads than cores, each runs at cores over threads
    # (``cluster/plan/shared_cores.py``).
    shared_cores: float | None = None


def step_seconds(model: StepTimeModel, prefill_tokens: int, attention: int, decodes: int, context: int) -> float:
    """A step's time by the worker's step-time model: the fixed cost once, each side's
    variable cost added (a step mixing both pays both)."""
    base = variable = 0.0
    if prefill_tokens and model.prefill is not None:
        a, b, c = model.prefill
        base, variable = max(base, a), variable + b * prefill_tokens + c * attention
    if decodes and model.decode is not None:
        a, b, c = model.decode
        base, variable = max(base, a), variable + b * decodes + c * context
    return base + variable


@dataclass(frozen=True)
class _Shape:
    """What ``EngineWorker`` reads of an engine's configuration."""

    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True)
class _ModelShape:
    vocab_size: int = 32000


@dataclass
class _Step:
    out: SchedulerOutput
    sampling: list[Request]
    seconds: float
    record: StepRecord


class SimEngine:
    """The engine with its model replaced by the step-time model: the real scheduler and block
    manager, the same step records. ``step()`` runs a step at once (for the start-up profile);
    the simulator splits it into ``begin_step`` and ``end_step`` around the step's time."""

    def __init__(self, spec: WorkerSpec, clock: Callable[[], float]):
        self.spec, self.clock = spec, clock
        self.config = _Shape(spec.block_size, spec.max_num_batched_tokens, spec.max_num_seqs)
        self.model_config = _ModelShape()
        self.max_model_len = spec.max_model_len
        self.block_manager = BlockManager(spec.num_blocks, spec.block_size, spec.prefix_caching)
        self.scheduler = Scheduler(self.block_manager, spec.max_num_batched_tokens, spec.max_num_seqs,
                                   spec.max_model_len, spec.chunked_prefill, HASH_KEYS)
        self.stats = EngineStats()
        self.sending: dict[str, int] = {}  # request id -> the first block its decode worker lacks

    def make_request(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 0) -> Request:
        return Request(request_id, list(prompt), params, priority=priority, arrival_time=self.clock())

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 0,
                    send_from_block: int | None = None) -> Request:
        request = self.make_request(request_id, prompt, params, priority)
        self.scheduler.add(request)
        if send_from_block is not None:
            self.sending[request_id] = send_from_block
        return request

    def reserve_transfer(self, request_id: str, prompt: list[int], params: SamplingParams,
                         priority: int = 0) -> tuple[int, list[int]] | None:
        """As the engine's: holds blocks for a prompt whose KV a prefill worker will send.
        (blocks already cached here, block ids the KV goes to), or None when blocks are short."""
        request = self.make_request(request_id, prompt, params, priority)
        first_block = self.scheduler.reserve_for_transfer(request)
        if first_block is None:
            return None
        self.stats.prompt_tokens += request.num_prompt_tokens
        self.stats.cached_prompt_tokens += request.num_cached_tokens
        return first_block, request.block_ids[first_block:]

    def admit_transfer(self, request_id: str, first_token: int) -> Request:
        """As the engine's: the KV arrived with the prefill worker's ``first_token``; the request joins the batch."""
        return self.scheduler.admit_transferred(request_id, first_token)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def begin_step(self) -> _Step | None:
        out = self.scheduler.schedule()
        self.stats.num_preemptions += len(out.preempted)
        if out.is_empty:
            return None
        bs = self.spec.block_size
        for request, _ in out.prefills:
            if request.times.first_scheduled is None:
                request.times.first_scheduled = self.clock()
                self.stats.prompt_tokens += request.num_prompt_tokens
                self.stats.cached_prompt_tokens += request.num_cached_tokens
        sampling = list(out.decodes) + [r for r, n in out.prefills if r.num_computed_tokens + n == r.num_tokens]
        sent = sum(-(-r.num_prompt_tokens // bs) - self.sending[r.request_id] for r, n in out.prefills
                   if r.request_id in self.sending and r.num_computed_tokens + n == r.num_prompt_tokens)
        prefill_tokens = out.num_tokens - len(out.decodes)
        attention = sum(n * (r.num_computed_tokens + n) for r, n in out.prefills)
        context = sum(r.num_computed_tokens + 1 for r in out.decodes)
        tail = self.spec.model.transfer_seconds(sent)
        seconds = step_seconds(self.spec.model, prefill_tokens, attention, len(out.decodes), context) + tail
        record = StepRecord(num_decode_tokens=len(out.decodes), num_prefill_tokens=prefill_tokens, seconds=seconds,
                            context_tokens=context, prefill_attention=attention, kv_blocks_sent=sent,
                            transfer_tail_s=tail)
        return _Step(out, sampling, seconds, record)

    def end_step(self, step: _Step) -> list[tuple[Request, int]]:
        """Applies the step: (request, token) for every request that sampled one."""
        tokens = {r.request_id: _token(r) for r in step.sampling}
        self.scheduler.update(step.out, tokens)
        self.stats.generated_tokens += len(tokens)
        self.stats.num_steps += 1
        self.stats.record(step.record)
        for request in step.sampling:
            if request.finished:
                self.sending.pop(request.request_id, None)
        return [(r, tokens[r.request_id]) for r in step.sampling]

    def step(self) -> list[tuple[Request, int]]:
        step = self.begin_step()
        return self.end_step(step) if step is not None else []


def _token(request: Request) -> int:
    """A simulated sampled token: deterministic, different along a request and across requests."""
    return FIRST_TOKEN_ID + zlib.crc32(f"{request.request_id}:{request.num_tokens}".encode()) % 30000


class _NoMetrics:
    """What ``EngineWorker._snapshot_held`` updates on a worker's metrics: nothing, in the simulator."""

    def blocks(self, *args) -> None:
        pass

    def speculation(self, *args) -> None:
        pass

    def host_tier(self, *args) -> None:
        pass


class SimWorker:
    """A worker of the simulated cluster: a ``SimEngine`` stepped on the simulator's clock.
    It has what ``step_profile.measure`` and ``EngineWorker._snapshot_held`` use (``engine``, ``name``,
    ``role``, ``_lock``, ``arrivals``, ``metrics``, ``node``, ``incarnation``), so the real ones run on it."""

    def __init__(self, name: str, role: str, spec: WorkerSpec, sim: "Simulator"):
        self.name, self.role, self.spec, self.sim = name, role, spec, sim
        self.node, self.incarnation = NodePlace(), name
        self.engine = SimEngine(spec, sim.now)
        self._lock = nullcontext()
        self.arrivals = RecentArrivals(sim.now)
        self.metrics = _NoMetrics()
        cores = sim.config.shared_cores  # the machine's cores, all of them open to every worker's threads
        self._compute_cores = (compute_cores_of(range(math.ceil(cores)), spec.threads * spec.tp) if cores
                               else NO_CORES)
        self.stepping = False
        self.calls: list[Callable[[], None]] = []
        self.busy_s = 0.0
        self.on_token: dict[str, Callable[[Request, int], None]] = {}

    def profile(self) -> None:
        step_profile.measure(self.engine, self.role)

    _unpaired_prefill = EngineWorker._unpaired_prefill  # its transfer pairs never fail
    _pull_from = EngineWorker._pull_from  # it pulls from no peer
    _pull_s_per_block = EngineWorker._pull_s_per_block
    _draft_prompt_share = EngineWorker._draft_prompt_share  # it builds no draft's KV of prompts

    def _prefill_call_s(self) -> float:
        """A decode worker's call to a prefill worker: the simulated message there and the answer's back."""
        return 2 * self.sim.config.hop_s if self.role == "decode" else 0.0

    def load(self) -> WorkerLoad:
        _, load = EngineWorker._snapshot_held(self)
        return replace(load, updated_at=self.sim.now())

    def call(self, fn: Callable[[], None]) -> None:
        """A call into the worker: it waits for the step in progress, then runs."""
        if self.stepping:
            self.calls.append(fn)
        else:
            fn()
            self.kick()

    def kick(self) -> None:
        if self.stepping or not self.engine.has_work():
            return
        step = self.engine.begin_step()
        if step is None:
            return
        self.stepping = True
        cores = self.sim.cores
        if cores is None:
            self.sim.after(step.seconds, lambda: self._end(step))
        else:  # its time as the shared cores let it run; the record says so, as a worker's would
            cores.start(self.name, step.seconds, self.spec.threads * self.spec.tp,
                        lambda wall: self._end(replace(step, seconds=wall, record=replace(step.record, seconds=wall))))

    def _end(self, step: _Step) -> None:
        self.busy_s += step.seconds
        for request, token in self.engine.end_step(step):
            handler = self.on_token.get(request.request_id)
            if handler is not None:
                handler(request, token)
            if request.finished:
                self.on_token.pop(request.request_id, None)
        self.stepping = False
        calls, self.calls = self.calls, []
        for fn in calls:
            fn()
        self.kick()


class _SimRegistry:
    """The router's view: each worker's last load report, and its cache's prefix hits."""

    def __init__(self, workers: dict[str, SimWorker]):
        self.workers = workers
        self.reports: dict[str, WorkerLoad] = {}

    def loads(self, workers) -> dict[str, WorkerLoad]:
        return {w: self.reports[w] for w in workers if w in self.reports}

    def prefix_tiers(self, block_hashes, workers) -> dict[str, TierHits]:
        out = {}
        for w in workers:
            if w not in self.workers:
                continue
            blocks = self.workers[w].engine.block_manager
            device = len(blocks.lookup_prefix(block_hashes))
            out[w] = TierHits(device, blocks.lookup_host_prefix(block_hashes[device:]))
        return out

    def loads_and_prefix_tiers(self, workers, block_hashes) -> tuple[dict[str, WorkerLoad], dict[str, TierHits]]:
        return self.loads(workers), self.prefix_tiers(block_hashes, workers)


@dataclass
class _Flight:
    """One request on its way, as the ingress sees it."""

    session: Session
    turn: int
    history: list[list[int]]
    result: RequestResult
    prompt: list[int]
    max_tokens: int
    decision: Decision | None = None
    placed_at: float | None = None
    no_room: int = 0
    on_done: Callable[["_Flight"], None] | None = None


@dataclass
class SimResult:
    results: list[RequestResult]
    utilisation: dict[str, float]  # busy share of the run's span, per worker
    router: dict
    span_s: float


class Simulator:
    def __init__(self, pools: Pools, config: SimConfig = SimConfig()):
        self.pools, self.config = pools, config
        self._now = EPOCH
        self._events: list = []
        self._order = itertools.count()
        self.workers = {name: SimWorker(name, role, spec, self) for name, role, spec in pools.workers()}
        if not self.workers:
            raise ValueError("a simulated cluster needs workers")
        names = {role: tuple(n for n, w in self.workers.items() if w.role == role)
                 for role in ("prefill", "decode", "colocated")}
        block_size = next(iter(self.workers.values())).spec.block_size
        self.registry = _SimRegistry(self.workers)
        self.router = Router(Topology(names["prefill"], names["decode"], block_size, HASH_KEYS, names["colocated"]),
                             self.registry, config.router)
        self.results: list[RequestResult] = []
        self._flights: dict[str, _Flight] = {}  # sent and not yet ended
        self._waiting: dict[str, _Flight] = {}  # held by the router
        self._retry_due = False
        self._pending_starts = 0  # session starts and later turns scheduled, not yet sent
        self._progress_at = EPOCH  # when a request was last sent or ended
        self.cores = SharedCores(config.shared_cores, self.now, self.after) if config.shared_cores else None

    # -- the clock --------------------------------------------------------------------------

    def now(self) -> float:
        return self._now

    def after(self, delay_s: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (self._now + max(0.0, delay_s), next(self._order), fn))

    # -- a run ------------------------------------------------------------------------------

    def run(self, workload: Workload, arrivals: Arrivals) -> SimResult:
        for worker in self.workers.values():
            worker.profile()
        for i, worker in enumerate(self.workers.values()):
            self.registry.reports[worker.name] = worker.load()
            self.after(REPORT_INTERVAL_S * (1 + i / len(self.workers)), lambda w=worker: self._report(w))
        duration = self.config.duration_s
        if arrivals.closed_loop:
            queue = iter(workload.sessions)

            def client() -> None:
                session = next(queue, None)
                if session is None or not self._sending_open():
                    return
                self._send(session, 0, [], client)

            self._pending_starts = arrivals.concurrency
            for _ in range(arrivals.concurrency):
                self.after(0.0, self._starting(client))
        else:
            for session, offset in zip(workload.sessions, session_start_offsets(workload, arrivals)):
                if duration is not None and offset >= duration:
                    break
                self._pending_starts += 1
                self.after(offset, self._starting(lambda s=session: self._send(s, 0, [], None)))
        while self._events:
            if not self._pending_starts and self._events[0][0] - self._progress_at > DRAIN_LIMIT_S:
                break
            at, _, fn = heapq.heappop(self._events)
            self._now = at
            fn()
        for flight in self._flights.values():
            flight.result.error = f"timeout: unfinished {DRAIN_LIMIT_S:g}s after the last progress (simulated)"
            self.results.append(flight.result)
        results = sorted(self.results, key=lambda r: r.sent_at)
        span = span_s(results)
        utilisation = {name: (w.busy_s / span if span else 0.0) for name, w in self.workers.items()}
        return SimResult(results, utilisation, self.router.status(self._now), span)

    def _starting(self, start: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            self._pending_starts -= 1
            start()

        return run

    def _sending_open(self) -> bool:
        return self.config.duration_s is None or self._now - EPOCH < self.config.duration_s

    # -- sessions ---------------------------------------------------------------------------

    def _send(self, session: Session, turn: int, history: list[list[int]], then: Callable | None) -> None:
        """Sends a session's turn; ``then`` starts a closed-loop client's next session."""
        if not self._sending_open():
            if then is not None:
                then()
            return
        self._progress_at = self._now
        prompt = session.prompt(turn, history)
        result = RequestResult(session.request_id(turn), session.slo_class, len(prompt), self._now - EPOCH)
        flight = _Flight(session, turn, history, result, prompt, session.turns[turn].max_tokens)
        flight.on_done = lambda f: self._turn_done(f, then)
        self._flights[result.request_id] = flight
        self.after(self.config.hop_s, lambda: self._place(flight))

    def _turn_done(self, flight: _Flight, then: Callable | None) -> None:
        self._progress_at = self._now
        self._flights.pop(flight.result.request_id, None)
        self.results.append(flight.result)
        session, turn = flight.session, flight.turn
        if flight.result.ok and turn + 1 < len(session.turns):
            history = flight.history + [answer_tokens(flight.result)]
            self._pending_starts += 1
            self.after(session.think_s, self._starting(lambda: self._send(session, turn + 1, history, then)))
        elif then is not None:
            then()

    # -- the request path -------------------------------------------------------------------

    def _route_request(self, flight: _Flight) -> RouteRequest:
        objectives = self.config.send_objectives
        return RouteRequest(request_id=flight.result.request_id, prompt_token_ids=flight.prompt,
                            max_tokens=flight.max_tokens, slo_class=flight.session.slo_class,
                            ttft_s=objectives.ttft_s if objectives else None,
                            tpot_s=objectives.tpot_s if objectives else None,
                            arrival=EPOCH + flight.result.sent_at)

    def _place(self, flight: _Flight) -> None:
        decision = self.router.submit(self._route_request(flight), self._now)
        if decision.action == "queue":
            self._waiting[decision.request_id] = flight
            self._retry_soon(self.config.router.load_refresh_s)
            return
        self._decided(flight, decision)  # the router runs in the ingress: its answer is no message

    def _retry_soon(self, delay_s: float = 0.0) -> None:
        if not self._retry_due:
            self._retry_due = True
            self.after(delay_s, self._retry)

    def _retry(self) -> None:
        self._retry_due = False
        for decision in self.router.retry_waiting(self._now):
            flight = self._waiting.pop(decision.request_id, None)
            if flight is not None:
                self._decided(flight, decision)
        if len(self.router.waiting):
            self._retry_soon(self.config.router.load_refresh_s)

    def _changed(self) -> None:
        if len(self.router.waiting):
            self._retry_soon(0.0)

    def _decided(self, flight: _Flight, decision: Decision) -> None:
        if decision.action == "reject":
            kind = "UNAVAILABLE" if decision.reason.startswith("no live") else "RESOURCE_EXHAUSTED"
            if kind == "RESOURCE_EXHAUSTED":  # as the bench counts a measured refusal
                flight.result.rejected, flight.result.finished_at = True, self._now - EPOCH
                flight.result.retry_after_s = decision.retry_after_s
            self._fail(flight, f"{kind}: {decision.reason}")
            return
        flight.decision, flight.placed_at = decision, self._now
        self.after(self.config.hop_s, lambda: self._dispatch(flight))

    def _dispatch(self, flight: _Flight) -> None:
        decision = flight.decision
        worker = self.workers[decision.decode]
        rid = flight.result.request_id
        priority = self.config.router.slo_class(flight.session.slo_class).priority
        params = SamplingParams(max_tokens=flight.max_tokens, ignore_eos=True)
        worker.on_token[rid] = lambda request, token: self._generated(flight, request, token)
        if decision.prefill is None:
            def add() -> None:
                try:
                    worker.engine.add_request(rid, flight.prompt, params, priority)
                except InvalidRequestError as exc:
                    worker.on_token.pop(rid, None)
                    self._after_router(flight, failed=True)
                    self._fail(flight, f"INVALID_ARGUMENT: {exc}")
                    return
                worker.arrivals.took(rid)

            worker.call(add)
            return

        def reserve() -> None:
            try:
                reserved = worker.engine.reserve_transfer(rid, flight.prompt, params, priority)
            except InvalidRequestError as exc:
                worker.on_token.pop(rid, None)
                self._after_router(flight, failed=True)
                self._fail(flight, f"INVALID_ARGUMENT: {exc}")
                return
            if reserved is None:
                worker.on_token.pop(rid, None)
                self.after(self.config.hop_s, lambda: self._no_room(flight))
                return
            worker.arrivals.took(rid)
            self.after(self.config.hop_s, lambda: self._prefill(flight, reserved[0]))

        worker.call(reserve)

    def _prefill(self, flight: _Flight, first_block: int) -> None:
        decision, rid = flight.decision, flight.result.request_id
        prefill, decode = self.workers[decision.prefill], self.workers[decision.decode]

        def first_token(request: Request, token: int) -> None:
            def admit() -> None:
                admitted = decode.engine.admit_transfer(rid, token)
                self._generated(flight, admitted, token)
                if admitted.finished:
                    decode.on_token.pop(rid, None)

            self.after(self.config.hop_s, lambda: decode.call(admit))

        def add() -> None:
            prefill.on_token[rid] = first_token
            prefill.engine.add_request(rid, flight.prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                                       send_from_block=first_block)
            prefill.arrivals.took(rid)

        prefill.call(add)

    def _no_room(self, flight: _Flight) -> None:
        self.router.forget(flight.result.request_id)
        self._changed()
        flight.no_room += 1
        if flight.no_room > NO_ROOM_RETRIES:
            self._fail(flight, f"UNAVAILABLE: {flight.decision.decode} had no free KV blocks "
                               f"{NO_ROOM_RETRIES} times")
            return
        self.after(0.01 * flight.no_room, lambda: self._place(flight))

    def _generated(self, flight: _Flight, request: Request, token: int) -> None:
        """A token left the decode worker; it reaches the client one hop later."""
        finished = request.finished
        cached = request.num_cached_tokens
        completion = request.num_output_tokens

        def arrive() -> None:
            now = self._now - EPOCH
            result = flight.result
            if result.first_token_at is None:
                result.first_token_at = now
            result.chunks.append((now, 1))
            result.output_token_ids.append(token)
            if finished:
                result.finished_at = now
                result.completion_tokens = completion
                result.cached_tokens = cached
                result.placement = (flight.decision.prefill or "", flight.decision.decode)
                self._after_router(flight)
                flight.on_done(flight)

        self.after(self.config.hop_s, arrive)

    def _after_router(self, flight: _Flight, failed: bool = False) -> None:
        result = flight.result
        service = None
        if not failed and result.first_token_at is not None and flight.placed_at is not None:
            service = (EPOCH + result.first_token_at) - flight.placed_at
        if failed:
            self.router.finished(result.request_id, None, self._now)
        else:
            self.router.finished(result.request_id, service, self._now)
        self._changed()

    def _fail(self, flight: _Flight, error: str) -> None:
        flight.result.error = error
        flight.on_done(flight)

    # -- reports ----------------------------------------------------------------------------

    def _report(self, worker: SimWorker) -> None:
        self.registry.reports[worker.name] = worker.load()
        if self._pending_starts or self._flights:
            self.after(REPORT_INTERVAL_S, lambda: self._report(worker))


def simulate(pools: Pools, workload: Workload, arrivals: Arrivals, config: SimConfig = SimConfig()) -> SimResult:
    return Simulator(pools, config).run(workload, arrivals)
