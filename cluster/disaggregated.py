"""Disaggregated serving on one machine: prefill workers and decode workers as Ray actors,
with each prompt's KV streamed layer by layer from the one to the other.

:class:`DisaggregatedLLM` has the interface of :class:`~cluster.engine.llm.LLM` (``generate``,
``run_until_done``, an ``engine`` that takes requests), so ``tandem run --disaggregated`` and
the Python API use it as they use the colocated engine. Per request it

1. reserves blocks on a decode worker (which reports how many leading blocks it already
   caches: those do not travel),
2. posts the decode worker's receive and the prefill worker's prefill at once; the prefill
   worker streams each layer as soon as it is computed,
3. admits the request into the decode worker's batch with the prefill's first token.

The pair is the router actor's choice (``router/``): it reads the registry (Redis: which
worker caches which blocks, how loaded each is), predicts each candidate's TTFT and TPOT, and
may reject a request no pair can serve in time, queue it, or have a decode worker that already
caches nearly all of the prompt prefill it itself. Without a Redis URL a private redis-server
is started on loopback and stopped with the cluster. Every finished request's TTFT and TPOT
go back to the router, which records goodput in the registry.

Every prefill worker is paired with every decode worker through a transfer group of its own
(ranks of both engines, ports from the cluster name). A worker that dies fails its requests
with an error naming it; the other side frees its blocks (a receive passes its deadline, a
send fails) and goes on serving, and later requests avoid the dead worker.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from cluster.engine.config import EngineConfig, EngineConfigError
from cluster.engine.engine import EngineStats, RequestOutput, Usage, prompt_token_ids
from cluster.engine.llm import LLM
from cluster.engine.models.config import load_model_config
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request, TransferTarget
from cluster.engine.scheduler import Scheduler
from cluster.engine.sampling_params import InvalidRequestError, SamplingParams
from cluster.engine.tokenizer import Tokenizer, TokenizerError
from cluster.kv_transfer.agent import PairLayout
from cluster.kv_transfer.sender import TAG_STRIDE
from cluster.kv_transfer.transport import TransportError, transport_class
from cluster.parallel.group import GroupSpec
from cluster.parallel.tp_runner import check_tensor_parallel
from cluster.ray_runtime import ensure_ray
from cluster.registry.load import read_loads
from cluster.registry.local_redis import LocalRedis
from cluster.registry.reporter import connect
from router.config import RouterConfig, RouterConfigError
from router.router import Decision, Topology

TAG_LIMIT = 2**30
MAX_RECEIVING_PER_DECODE = 16  # each holds a thread on every rank of the decode engine until its KV lands
REGISTRY_WAIT_S = 30.0
QUEUE_RETRY_S = 0.02
TRANSFERS_KEPT = 100_000  # how soon a request the router queued is offered again


@dataclass
class _Queued:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: float
    slo_class: str | None = None
    stream: bool = False  # report every new token, not just the end
    ttft_s: float | None = None  # explicit objectives, in place of the class's
    tpot_s: float | None = None


@dataclass
class _InFlight:
    request: _Queued
    decode: int
    prefill: int
    receive_ref: object
    prefill_ref: object
    first_block: int


@dataclass
class _Started:
    """A placed request until its output is collected: what its TTFT and TPOT are taken from."""

    request: _Queued
    decode: int
    dispatched: float
    first_token: float | None = None  # when the KV landed and the first token was known (driver clock)


@dataclass(frozen=True)
class PoolResources:
    """What each rank of a pool's workers reserves; a worker's ranks share one placement group
    packed on one node (STRICT_PACK), so a TP group never spans nodes."""

    cpus_per_rank: float = 0.25
    gpus_per_rank: int = 0
    resources: tuple[tuple[str, float], ...] = ()  # custom Ray resources per rank

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.cpus_per_rank, **dict(self.resources)}
        if self.gpus_per_rank:
            bundle["GPU"] = float(self.gpus_per_rank)
        return bundle


@dataclass(frozen=True)
class TransferStat:
    request_id: str
    prefill_worker: int
    decode_worker: int
    blocks_cached_on_decode: int
    blocks_sent: int
    prefill_cached_tokens: int = 0  # hits in the prefill worker's own cache


class _Frontend:
    """What ``run_file`` and ``LLM.generate`` use of an engine: requests in, stats out.

    Requests are checked on arrival as a decode worker's scheduler would check them (context
    length, blocks), so a request that can never run is refused at once, like the colocated
    engine does; ``limits`` is set once the decode workers have started."""

    def __init__(self, model_dir: Path, vocab_size: int):
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(model_dir)
        except TokenizerError:
            self.tokenizer = None
        self.vocab_size = vocab_size
        self.queue: list[_Queued] = []
        self.stats = EngineStats()
        self.limits: Scheduler | None = None
        self.router_config = RouterConfig()

    routes_by_slo = True

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    priority: int = 0, slo_class: str | None = None, stream: bool = False,
                    ttft_s: float | None = None, tpot_s: float | None = None) -> None:
        token_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size)
        if any(q.request_id == request_id for q in self.queue):
            raise InvalidRequestError(f"request id {request_id!r} is already queued")
        params = params or SamplingParams()
        if self.limits is not None:
            self.limits.check(Request(request_id, token_ids, params))
        try:
            cls = self.router_config.slo_class(slo_class)
        except RouterConfigError as exc:
            raise InvalidRequestError(str(exc)) from None
        for name, value in (("ttft", ttft_s), ("tpot", tpot_s)):
            if value is not None and not value > 0:
                raise InvalidRequestError(f"objectives.{name}_ms must be positive, got {value * 1000:g}")
        self.queue.append(_Queued(request_id, token_ids, params, priority + cls.priority, time.monotonic(), cls.name,
                                  stream, ttft_s, tpot_s))


class DisaggregatedLLM(LLM):
    def __init__(
        self,
        model: str | None = None,
        verbose: bool = True,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        prefill_workers: int = 1,
        decode_workers: int = 1,
        cluster_name: str = "tandem",
        ray_address: str | None = None,
        transfer_timeout_s: float = 60.0,
        kv_transport: str = "torch_distributed",
        stream_layers: bool = True,
        policy: str = "slo",
        router_config: RouterConfig | None = None,
        registry_url: str | None = None,
        pools: dict[str, PoolResources] | None = None,
        role_args: dict[str, dict] | None = None,
        **engine_args,
    ):
        """``engine_args`` are EngineConfig fields for both roles; ``role_args["prefill"]`` and
        ``role_args["decode"]`` override them per role; ``pools`` sets each role's resources."""
        if model is None:
            from cluster.default_model import default_model_path

            model = str(default_model_path())
        for name, value in (("prefill_workers", prefill_workers), ("decode_workers", decode_workers)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        model_dir = Path(model)
        config = load_model_config(model_dir, engine_args.get("dtype"))
        for side, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
            try:
                check_tensor_parallel(config, tp)
            except ValueError as exc:
                raise EngineConfigError(f"{side}: {exc}") from None
        try:
            transport_class(kv_transport)
        except TransportError as exc:
            raise EngineConfigError(str(exc)) from None
        try:
            router_config = router_config or RouterConfig.for_policy(policy)
        except RouterConfigError as exc:
            raise EngineConfigError(str(exc)) from None
        ray = self._ray = ensure_ray(cluster_name, ray_address)
        self.engine = _Frontend(model_dir, config.vocab_size)
        self.engine.router_config = router_config
        self.cluster_name = cluster_name
        if registry_url is not None:
            _check_registry(registry_url)
        self.local_redis = LocalRedis() if registry_url is None else None
        self.registry_url = registry_url or self.local_redis.url
        self.num_layers = config.num_layers
        self.architecture = config.architecture
        self.transfer_timeout_s = transfer_timeout_s
        self.stream_layers = stream_layers
        self.verbose = verbose
        self.transfers: deque[TransferStat] = deque(maxlen=TRANSFERS_KEPT)  # the most recent, for stats
        common = dict(model=str(model_dir), cluster_name=cluster_name, ray_address=ray_address, **engine_args)

        from decode_worker.worker import DecodeWorker
        from prefill_worker.worker import PrefillWorker

        device = common.pop("device", "cpu")
        gpus = itertools.count(int(device.partition(":")[2] or 0)) if device.startswith("cuda") else None

        def device_for(tp: int) -> str:
            """On GPUs each worker's ranks take the next ``tp`` devices of this node."""
            if gpus is None:
                return device
            first = next(gpus)
            for _ in range(tp - 1):
                next(gpus)
            return f"cuda:{first}"

        started = time.perf_counter()
        pools = pools or {}
        role_args = role_args or {}
        self.placement_groups = []
        self.prefill, self.decode = [], []

        def start(cls, role: str, index: int, tp: int, concurrency: int):
            name = f"{role}-{index}"
            pool = pools.get(role, PoolResources())
            strategy = self._reserve(name, tp, pool)
            # With GPUs per rank, Ray assigns each rank its device (it sees only that one, as cuda:0).
            config = EngineConfig(**{**common, **role_args.get(role, {})}, tensor_parallel_size=tp, engine_name=name,
                                  device="cuda:0" if pool.gpus_per_rank else device_for(tp),
                                  cpus_per_rank=pool.cpus_per_rank, gpus_per_rank=pool.gpus_per_rank)
            return ray.remote(cls).options(name=name, num_cpus=pool.cpus_per_rank, num_gpus=pool.gpus_per_rank,
                                           max_concurrency=concurrency,
                                           scheduling_strategy=strategy).remote(config, self.registry_url)

        try:
            self.prefill = [start(PrefillWorker, "prefill", i, prefill_tp, 64) for i in range(prefill_workers)]
            self.decode = [start(DecodeWorker, "decode", i, decode_tp, 16) for i in range(decode_workers)]
            described = ray.get([w.describe.remote() for w in self.prefill + self.decode])
            smallest = min(described[len(self.prefill):], key=lambda d: d["num_blocks"])
            self.engine.limits = Scheduler(BlockManager(smallest["num_blocks"], smallest["block_size"]), 1, 1,
                                           smallest["max_model_len"])
            joins = []
            for p, d in itertools.product(range(prefill_workers), range(decode_workers)):
                layout = PairLayout(self._pair(p, d), prefill_tp, decode_tp, config.num_kv_heads, kv_transport)
                spec = GroupSpec(cluster_name, f"kv-p{p}-d{d}", layout.size)
                joins += [self.prefill[p].join_pair.remote(layout, spec), self.decode[d].join_pair.remote(layout, spec)]
            ray.get(joins)
            from router.actor import RouterActor

            self.names = [d["name"] for d in described]
            topology = Topology(tuple(self.names[:prefill_workers]), tuple(self.names[prefill_workers:]),
                                smallest["block_size"], tuple(smallest["hash_keys"]))
            self.router = ray.remote(RouterActor).options(name="router", num_cpus=0.1).remote(
                cluster_name, self.registry_url, topology, router_config, str(model_dir))
            self._wait_for_registry()
        except BaseException:
            self.shutdown()
            raise
        self._tags = {self._pair(p, d): itertools.count() for p in range(prefill_workers) for d in range(decode_workers)}
        self._dead_decode: set[int] = set()
        self._dead_prefill: set[int] = set()
        self._started: dict[str, _Started] = {}  # placed request id -> its decode worker and times
        self._inflight: dict[str, _InFlight] = {}  # KV on its way
        self._unclaimed: dict[str, RequestOutput] = {}  # finished while run_until_done waited for others
        self._retry_at = 0.0
        self._cancelled: set[str] = set()  # aborted while their KV was on the way
        self.decisions: dict[str, Decision] = {}
        if verbose:
            registry = "private redis-server on " + self.registry_url if self.local_redis else "Redis registry"
            print(f"[tandem] disaggregated: {prefill_workers} prefill worker(s) TP {prefill_tp}, {decode_workers} decode "
                  f"worker(s) TP {decode_tp}, router policy {router_config.policy}, {registry}; ready in "
                  f"{time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)

    @staticmethod
    def _pair(prefill: int, decode: int) -> str:
        return f"p{prefill}-d{decode}"

    def _reserve(self, name: str, tp: int, pool: PoolResources):
        """A placement group of ``tp`` bundles packed on one node for a worker's ranks; its
        scheduling strategy (rank 0 in bundle 0, the other ranks captured into the rest)."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = placement_group([pool.bundle()] * tp, strategy="STRICT_PACK", name=f"{self.cluster_name}-{name}")
        self.placement_groups.append(group)
        if not group.wait(REGISTRY_WAIT_S):
            raise EngineConfigError(
                f"cannot place {name}: its {tp} rank(s) need {pool.bundle()} each, together on one node, and the "
                f"Ray cluster has no such room (see `ray status`)")
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                placement_group_capture_child_tasks=True)

    def _wait_for_registry(self) -> None:
        """Until every worker's first report is in the registry (they report right after their
        profile), so the router's first placements see measured step times."""
        client = connect(self.registry_url)
        deadline = time.monotonic() + REGISTRY_WAIT_S
        try:
            while time.monotonic() < deadline:
                if len(read_loads(client, self.cluster_name, self.names)) == len(self.names):
                    return
                time.sleep(0.05)
        finally:
            client.close()
        print(f"[tandem] not every worker reported to the registry within {REGISTRY_WAIT_S:.0f}s; the router "
              "places by load until they do", file=sys.stderr, flush=True)

    def worker_status(self) -> list[dict]:
        """Each worker's status; a worker that does not answer is listed as dead."""
        ray = self._ray
        refs = [w.status.remote() for w in self.prefill + self.decode]
        rows = []
        for name, ref in zip(self.names, refs):
            try:
                rows.append(ray.get(ref, timeout=10))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                rows.append({"name": name, "role": name.partition("-")[0], "state": "dead"})
        return rows

    def router_status(self) -> dict:
        return self._ray.get(self.router.status.remote())

    def goodput(self) -> dict | None:
        """Goodput and SLO attainment per cluster, worker and SLO class (last minute, last hour)."""
        return self._ray.get(self.router.goodput.remote())

    def shutdown(self) -> None:
        ray = self._ray
        for worker in getattr(self, "prefill", []) + getattr(self, "decode", []):
            try:
                ray.get(worker.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead worker has nothing left to stop
                pass
            ray.kill(worker, no_restart=True)
        self.prefill, self.decode = [], []
        router = getattr(self, "router", None)
        if router is not None:
            ray.kill(router, no_restart=True)
            self.router = None
        from ray.util.placement_group import remove_placement_group

        for group in getattr(self, "placement_groups", []):
            remove_placement_group(group)
        self.placement_groups = []
        if getattr(self, "local_redis", None) is not None:
            self.local_redis.stop()
            self.local_redis = None

    # -- running requests -------------------------------------------------------------------

    def _error_output(self, queued: _Queued, message: str, kind: str = "unavailable",
                      reason: str = "error") -> RequestOutput:
        return RequestOutput(
            request_id=queued.request_id, prompt_token_ids=queued.prompt_token_ids, token_ids=[], new_token_ids=[],
            text="", delta_text="", finished=True, finish_reason=reason, error=message if reason == "error" else None,
            usage=Usage(len(queued.prompt_token_ids), 0, 0), arrival_time=queued.arrival, finish_time=time.monotonic(),
            error_kind=kind if reason == "error" else None,
        )

    def _worker_died(self, side: str, index: int) -> None:
        (self._dead_decode if side == "decode" else self._dead_prefill).add(index)
        self.router.worker_failed.remote(f"{side}-{index}")

    def _dispatch(self, queued: _Queued, busy_decode: set[int] = frozenset()) -> _InFlight | RequestOutput | None:
        """Starts one request where the router places it; an error output if it cannot run or
        the router rejects it; None if it must wait (the router queued it, or the decode worker
        has no free blocks or already has its most receives in flight)."""
        ray, rid = self._ray, queued.request_id
        decision = ray.get(self.router.route.remote(rid, queued.prompt_token_ids, queued.params.max_tokens,
                                                    queued.slo_class, None, queued.ttft_s, queued.tpot_s))
        if decision.action == "reject":
            if decision.decode is None and decision.reason.startswith("no live"):
                return self._error_output(queued, decision.reason, "unavailable")
            return self._error_output(queued, f"rejected by admission control: {decision.reason}", "rejected")
        if decision.action == "queue":
            return None
        d = int(decision.decode.rpartition("-")[2])
        p = None if decision.prefill is None else int(decision.prefill.rpartition("-")[2])
        if d in busy_decode:
            self.router.forget.remote(rid)
            return None
        self.decisions[rid] = decision
        dispatched = time.monotonic()
        if p is None:
            try:
                ray.get(self.decode[d].generate.remote(rid, queued.prompt_token_ids, queued.params, queued.priority,
                                                       queued.stream))
            except ray.exceptions.RayActorError:
                self._worker_died("decode", d)
                self.router.forget.remote(rid)
                return self._dispatch(queued, busy_decode)
            except ray.exceptions.RayTaskError as exc:
                self.router.forget.remote(rid)
                return self._error_output(queued, str(getattr(exc, "cause", exc)), "invalid")
            self._started[rid] = _Started(queued, d, dispatched)
            return _InFlight(queued, d, -1, None, None, 0)
        try:
            reserved = ray.get(self.decode[d].reserve.remote(
                rid, queued.prompt_token_ids, queued.params, queued.priority))
        except ray.exceptions.RayTaskError as exc:
            self.router.forget.remote(rid)
            cause = getattr(exc, "cause", None)
            if isinstance(cause, InvalidRequestError):
                return self._error_output(queued, str(cause), "invalid")
            return self._error_output(queued, str(exc))
        except ray.exceptions.RayActorError:
            self._worker_died("decode", d)
            self.router.forget.remote(rid)
            return self._dispatch(queued, busy_decode)
        if reserved is None:
            self.router.forget.remote(rid)
            return None
        first_block, dst_blocks = reserved
        pair = self._pair(p, d)
        tag_base = next(self._tags[pair]) * self.num_layers * TAG_STRIDE % TAG_LIMIT
        target = TransferTarget(pair, tag_base, first_block, self.transfer_timeout_s, self.stream_layers)
        receive = self.decode[d].receive.remote(pair, rid, dst_blocks, tag_base, self.transfer_timeout_s)
        prefill = self.prefill[p].prefill.remote(rid, queued.prompt_token_ids, queued.params, target)
        self._started[rid] = _Started(queued, d, dispatched)
        return _InFlight(queued, d, p, receive, prefill, first_block)

    def _complete(self, flight: _InFlight) -> RequestOutput | None:
        """Both halves ended: admit the request, or fail it (freeing the decode side)."""
        ray, rid = self._ray, flight.request.request_id
        errors = []
        try:
            receive_error = ray.get(flight.receive_ref)
        except ray.exceptions.RayActorError:
            self._worker_died("decode", flight.decode)
            receive_error = f"decode worker {flight.decode} died"
        if receive_error:
            errors.append(f"receive: {receive_error}")
        try:
            result = ray.get(flight.prefill_ref)
            if result.error:
                errors.append(f"prefill: {result.error}")
        except ray.exceptions.RayActorError:
            self._worker_died("prefill", flight.prefill)
            result = None
            errors.append(f"prefill worker {flight.prefill} died")
        cancelled = rid in self._cancelled
        if errors or cancelled:
            self._cancelled.discard(rid)
            self._started.pop(rid, None)
            self.router.finished.remote(rid, None, None, not cancelled)
            if flight.decode not in self._dead_decode:
                self.decode[flight.decode].release.remote(rid)
            if cancelled:
                return self._error_output(flight.request, "", reason="abort")
            return self._error_output(flight.request, "KV transfer failed: " + "; ".join(errors))
        self.transfers.append(TransferStat(rid, flight.prefill, flight.decode, flight.first_block, result.blocks_sent,
                                          result.cached_tokens))
        self.decode[flight.decode].admit.remote(rid, result.first_token, result.first_logprob,
                                                result.first_top_logprobs, flight.request.stream)
        self._started[rid].first_token = time.monotonic()
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.engine.queue or self._inflight or self._started)

    def step(self, wait_s: float = 0.01) -> list[RequestOutput]:
        """One turn of the driver: offers queued requests to the router (highest priority,
        then oldest, first), admits those whose KV has landed, and returns what came back since
        the last turn: every finished request, and the new tokens of streamed ones. Waits up to
        ``wait_s`` for a transfer to end."""
        ray = self._ray
        results: list[RequestOutput] = []
        queue = self.engine.queue
        queue.sort(key=lambda q: (-q.priority, q.arrival))
        max_inflight = 16 * len(self.prefill)  # enough for each prefill worker to batch
        while queue and len(self._inflight) < max_inflight and time.monotonic() >= self._retry_at:
            receiving = [f.decode for f in self._inflight.values()]
            busy = {d for d in set(receiving) if receiving.count(d) >= MAX_RECEIVING_PER_DECODE}
            started_one = self._dispatch(queue[0], busy)
            if started_one is None:
                self._retry_at = time.monotonic() + QUEUE_RETRY_S
                break
            queued = queue.pop(0)
            if isinstance(started_one, RequestOutput):
                results.append(started_one)
            elif started_one.prefill_ref is not None:
                self._inflight[queued.request_id] = started_one
        refs = [ref for f in self._inflight.values() for ref in (f.receive_ref, f.prefill_ref)]
        if refs:
            ray.wait(refs, num_returns=1, timeout=wait_s)
        for rid, flight in list(self._inflight.items()):
            ready, _ = ray.wait([flight.receive_ref, flight.prefill_ref], num_returns=2, timeout=0)
            if len(ready) == 2:
                del self._inflight[rid]
                failed = self._complete(flight)
                if failed is not None:
                    results.append(failed)
        results += self._collect()
        if not refs:
            time.sleep(0.002)
        self._update_stats(o for o in results if o.finished)
        return results

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancels a request wherever it is: dropped from the queue, released on its decode
        worker (its blocks free at once), or, while its KV is on the way, released as soon as the
        transfer ends. Returns its final output, or None when that comes from a later step."""
        for queued in self.engine.queue:
            if queued.request_id == request_id:
                self.engine.queue.remove(queued)
                return self._error_output(queued, "", reason="abort")
        if request_id in self._inflight:
            self._cancelled.add(request_id)
            return None
        started = self._started.pop(request_id, None)
        if started is None:
            return None
        self.router.finished.remote(request_id, None, None, False)
        if started.decode not in self._dead_decode:
            self.decode[started.decode].release.remote(request_id)
        return self._error_output(started.request, "", reason="abort")

    def run_until_done(self, request_ids: Sequence[str], progress: bool = False) -> list[RequestOutput]:
        wanted = set(request_ids)
        results = {rid: self._unclaimed.pop(rid) for rid in list(self._unclaimed) if rid in wanted}
        last_report = time.perf_counter()
        while len(results) < len(wanted):
            for output in self.step():
                if output.finished:
                    (results if output.request_id in wanted else self._unclaimed)[output.request_id] = output
            if progress and time.perf_counter() - last_report > 2.0:
                last_report = time.perf_counter()
                print(f"\r[tandem] {len(results)}/{len(wanted)} requests done", end="", file=sys.stderr, flush=True)
        if progress:
            print(file=sys.stderr)
        return [results[i] for i in request_ids]

    def _collect(self) -> list[RequestOutput]:
        """Gathers what the decode workers produced; tells the router each finished request's
        TTFT and TPOT."""
        ray = self._ray
        outputs: list[RequestOutput] = []
        polls = {d: worker.poll.remote() for d, worker in enumerate(self.decode) if d not in self._dead_decode}
        for d, ref in polls.items():
            try:
                outputs += ray.get(ref)
            except ray.exceptions.RayActorError:
                self._worker_died("decode", d)
        returned: list[RequestOutput] = []
        for output in outputs:
            started = self._started.get(output.request_id)
            if started is None:
                continue  # aborted meanwhile
            if output.finished:
                del self._started[output.request_id]
                self._finish(started, output)
            returned.append(output)
        for rid, started in list(self._started.items()) if self._dead_decode else ():
            if started.decode in self._dead_decode and rid not in self._inflight:
                del self._started[rid]
                output = self._error_output(started.request, f"decode worker {started.decode} died while generating")
                self._finish(started, output)
                returned.append(output)
        return returned

    def _finish(self, started: _Started, output: RequestOutput) -> None:
        _on_driver_clock(started, output)
        ttft, tpot = _latencies(output)
        self.router.finished.remote(output.request_id, ttft, tpot, output.finish_reason == "error")

    def _update_stats(self, outputs) -> None:
        stats = self.engine.stats
        for output in outputs:
            stats.prompt_tokens += output.usage.prompt_tokens
            stats.cached_prompt_tokens += output.usage.cached_tokens
            stats.generated_tokens += output.usage.completion_tokens

    def worker_free_blocks(self) -> tuple[list[int | None], list[int | None]]:
        """Free KV blocks of each prefill and decode worker (None for a dead one)."""
        free = [w["kv_blocks"] - w["kv_blocks_used"] if w["state"] == "alive" else None
                for w in self.worker_status()]
        return free[:len(self.prefill)], free[len(self.prefill):]


def _on_driver_clock(started: _Started, output: RequestOutput) -> None:
    """Puts the output's times on this driver's clock: arrival when it reached the driver,
    the first token when the driver knew it (the KV landed; or, for a request its decode worker
    prefilled itself, as long after dispatch as it took there), the finish as long after the
    first token as the decode worker measured."""
    first = started.first_token
    if first is None and output.first_token_time is not None:
        first = started.dispatched + (output.first_token_time - output.arrival_time)
    decoding = (output.finish_time - output.first_token_time
                if output.finish_time is not None and output.first_token_time is not None else None)
    output.arrival_time = started.request.arrival
    output.scheduled_time = started.dispatched
    output.first_token_time = first
    output.finish_time = first + decoding if first is not None and decoding is not None else time.monotonic()


def _latencies(output: RequestOutput) -> tuple[float | None, float | None]:
    """TTFT and TPOT (None when there is no first token, or fewer than two tokens)."""
    if output.first_token_time is None:
        return None, None
    n = output.usage.completion_tokens
    tpot = (output.finish_time - output.first_token_time) / (n - 1) if n >= 2 else None
    return output.first_token_time - output.arrival_time, tpot


def _check_registry(url: str) -> None:
    import redis

    try:
        client = connect(url, timeout_s=5.0)
    except ValueError as exc:
        raise EngineConfigError(f"--redis-url: {exc}") from None
    try:
        client.ping()
    except redis.RedisError as exc:
        where = client.connection_pool.connection_kwargs
        raise EngineConfigError(f"cannot reach the registry Redis at {where.get('host')}:{where.get('port')} "
                                f"(db {where.get('db', 0)}): {exc}") from None
    finally:
        client.close()
