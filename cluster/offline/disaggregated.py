"""Disaggregated serving without a server: ``tandem run --disaggregated`` and the Python API.

:class:`DisaggregatedLLM` has the interface of :class:`~cluster.offline.llm.LLM` (``generate``,
``run_until_done``, an ``engine`` that takes requests), so ``tandem run --disaggregated`` and
the Python API use it as they use the colocated engine. It starts a :class:`Deployment`
(prefill and decode workers as Ray actors, the registry) and sends every request down the
same :class:`~cluster.ingress.request_path.RequestPath` an ingress replica uses: its router, in this
process, places it, the decode worker fetches its KV from the prefill worker and streams the tokens
back. One request flow, whether a request comes from a file or over the API.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Sequence

from cluster.deployment.deployment import Deployment
from cluster.deployment.pools import EngineOverrides, PoolResources
from cluster.engine.chat_template import ChatPrompt
from cluster.engine.engine import EngineStats, RequestOutput, Usage
from cluster.offline.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.ingress.request_path import RequestPath
from cluster.protocol.messages import ApiRequest, RequestFailed
from cluster.offline.spec_from_args import disaggregated_spec
from cluster.runtime.startup import CLI_SETTINGS
from cluster.topology import ClusterSpec

TRANSFERS_KEPT = 100_000

__all__ = ["DisaggregatedLLM", "EngineOverrides", "PoolResources", "TransferStat"]


@dataclass(frozen=True)
class TransferStat:
    request_id: str
    prefill_worker: str
    decode_worker: str
    blocks_cached_on_decode: int
    blocks_sent: int
    prefill_cached_tokens: int = 0  # hits in the prefill worker's own cache
    bytes: int = 0  # KV bytes sent
    draft_bytes: int = 0  # of those, the draft model's KV of the prompt (built by the prefill worker)


class _Requests:
    """What ``run_file`` and ``LLM.generate`` use of an engine: requests in (checked at once, as
    the API would check them), stats out."""

    routes_by_slo = True

    def __init__(self, owner: "DisaggregatedLLM"):
        self.owner = owner
        self.tokenizer = owner.path.tokenizer
        self.vocab_size = owner.path.info.vocab_size
        self.stats = EngineStats()

    def add_request(self, request_id: str, prompt: str | Sequence[int] | ChatPrompt,
                    params: SamplingParams | None = None, priority: int = 0, slo_class: str | None = None,
                    ttft_s: float | None = None, tpot_s: float | None = None) -> None:
        request = ApiRequest(prompt if isinstance(prompt, (str, ChatPrompt)) else list(prompt), request_id=request_id,
                             sampling=params or SamplingParams(), priority=priority, slo_class=slo_class or "",
                             ttft_s=ttft_s, tpot_s=tpot_s)
        self.owner.path.check(request)  # raises InvalidRequestError naming what to fix
        self.owner.submit(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.owner.pending)


class DisaggregatedLLM(LLM):
    """Serves a topology's deployment in this process: ``DisaggregatedLLM(spec)``, or
    :meth:`from_args` with ``tandem run --disaggregated``'s arguments. Every prompt given is
    answered: the router ranks its placements by the request's SLO class but never refuses one
    (admission control is the serving APIs'); a prompt waits for room instead."""

    def __init__(self, spec: ClusterSpec, engine: EngineOverrides = EngineOverrides(), verbose: bool = True):
        """``engine`` holds the EngineConfig fields the topology does not (``--seed``, ``--device``...)."""
        self.deployment = Deployment(spec, engine, verbose=verbose, settings=CLI_SETTINGS).start()
        self._ray = self.deployment._ray
        self.verbose = verbose
        self.architecture = self.deployment.info.architecture
        self.prefill = [self.deployment.workers[n] for n in self.deployment.info.prefill]
        self.decode = [self.deployment.workers[n] for n in self.deployment.info.decode]
        self.transfers: deque[TransferStat] = deque(maxlen=TRANSFERS_KEPT)
        self.decisions: dict = {}  # request id -> the router's last decision for it
        self.migrations: dict[str, int] = {}  # request id -> times it moved after a worker failed under it
        self.pending: dict[str, object] = {}  # request id -> its future
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="request-paths", daemon=True)
        self._thread.start()
        try:
            self.path = RequestPath(self.deployment.info, api="offline")
            self._on_loop(self.path.start())
        except BaseException:
            self.shutdown()
            raise
        self.engine = _Requests(self)

    @classmethod
    def from_args(cls, model: str | None = None, verbose: bool = True, **kwargs) -> "DisaggregatedLLM":
        """From the arguments of :func:`~cluster.offline.spec_from_args.disaggregated_spec`."""
        return cls(*disaggregated_spec(model, **kwargs), verbose=verbose)

    # -- running requests -------------------------------------------------------------------

    def submit(self, request: ApiRequest) -> None:
        request = replace(request, arrival=time.time())
        future = asyncio.run_coroutine_threadsafe(self._collect(request), self._loop)
        self.pending[request.request_id] = future

    async def _collect(self, request: ApiRequest) -> RequestOutput:
        """Runs one request's path to its end; its output as the colocated engine gives it."""
        arrival = time.monotonic()
        token_ids, text, logprobs, top = [], [], [], []
        wants_logprobs = request.sampling.logprobs is not None
        last = None
        async for message in self.path.generate(request):
            last = message
            if isinstance(message, RequestFailed):
                break
            token_ids += message.token_ids
            text.append(message.text)
            for logprob, row in message.logprobs or []:
                logprobs.append(logprob)
                top.append([tuple(pair) for pair in row])
        if isinstance(last, RequestFailed):
            return RequestOutput(request_id=request.request_id, prompt_token_ids=[], token_ids=[],
                                 new_token_ids=[], text="", delta_text="", finished=True, finish_reason="error",
                                 error=last.message, usage=Usage(0, 0, 0), arrival_time=arrival,
                                 finish_time=time.monotonic(), error_kind=last.kind)
        end = last.end
        await end.router_told  # its goodput record is in before the caller can ask for goodput
        usage, timings = end.usage, end.timings
        queue_ms, ttft_ms, e2e_ms = timings.queue_ms, timings.ttft_ms, timings.e2e_ms
        decision, transfer = end.decision, end.transfer
        if decision is not None:
            self.decisions[request.request_id] = decision
        self.migrations[request.request_id] = end.migrations
        if transfer is not None:
            self.transfers.append(TransferStat(request.request_id, transfer.prefill, decision.decode,
                                               transfer.blocks_cached_on_decode, transfer.blocks_sent,
                                               transfer.prefill_cached_tokens, transfer.bytes, transfer.draft_bytes))
        return RequestOutput(
            request_id=request.request_id, prompt_token_ids=[], token_ids=token_ids, new_token_ids=[],
            text="".join(text), delta_text="", finished=True, finish_reason=end.finish_reason, error=None,
            usage=Usage(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, usage.proposed_tokens,
                        usage.accepted_tokens),
            logprobs=logprobs if wants_logprobs else None, top_logprobs=top if wants_logprobs else None,
            arrival_time=arrival, first_token_time=arrival + ttft_ms / 1000, finish_time=arrival + e2e_ms / 1000,
            scheduled_time=arrival + queue_ms / 1000)

    def run_until_done(self, request_ids: Sequence[str], progress: bool = False) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        last_report = time.perf_counter()
        for request_id in request_ids:
            future = self.pending[request_id]
            while True:
                try:
                    results[request_id] = future.result(timeout=2.0)
                    break
                except TimeoutError:
                    if progress:
                        print(f"\r[tandem] {len(results)}/{len(request_ids)} requests done", end="", file=sys.stderr,
                              flush=True)
            del self.pending[request_id]
            if progress and time.perf_counter() - last_report > 2.0:
                last_report = time.perf_counter()
                print(f"\r[tandem] {len(results)}/{len(request_ids)} requests done", end="", file=sys.stderr,
                      flush=True)
        if progress:
            print(file=sys.stderr)
        stats = self.engine.stats
        for output in results.values():
            stats.prompt_tokens += output.usage.prompt_tokens
            stats.cached_prompt_tokens += output.usage.cached_tokens
            stats.generated_tokens += output.usage.completion_tokens
        return [results[i] for i in request_ids]

    # -- looking at it --------------------------------------------------------------------------

    @property
    def registry_url(self) -> str:
        return self.deployment.registry_url

    @property
    def local_redis(self):
        """The private redis-server (None with a registry URL)."""
        return self.deployment.local_redis

    @property
    def kv_shares(self) -> dict[str, float]:
        """Each worker's share of its node's KV budget."""
        return {name: config.kv_memory_share for name, config in self.deployment.configs.items()}

    def worker_status(self) -> list[dict]:
        return self.deployment.worker_status()

    def _on_loop(self, coroutine, timeout_s: float = 60.0):
        """Runs a coroutine on the loop the requests' paths run on; its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=timeout_s)

    def router_status(self) -> dict:
        async def status() -> dict:
            return self.path.router.status()

        return self._on_loop(status())

    def goodput(self) -> dict | None:
        """Goodput and SLO attainment per cluster, worker and class (last minute, last hour)."""
        return self.path.router.goodput()

    def worker_free_blocks(self) -> tuple[list[int | None], list[int | None]]:
        """Free KV blocks of each prefill and decode worker (None for a dead one)."""
        free = {w["name"]: w["kv_blocks"] - w["kv_blocks_used"] if w["state"] == "alive" else None
                for w in self.worker_status()}
        info = self.deployment.info
        return [free[n] for n in info.prefill], [free[n] for n in info.decode]

    def shutdown(self) -> None:
        for future in list(getattr(self, "pending", {}).values()):
            future.cancel()
        loop = getattr(self, "_loop", None)
        if loop is not None and loop.is_running():
            if getattr(self, "path", None) is not None:
                try:
                    self._on_loop(self.path.stop(), timeout_s=10)
                except Exception:  # noqa: BLE001 - stopping anyway; its records are lost with the registry
                    pass
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=10)
        deployment = getattr(self, "deployment", None)
        if deployment is not None:
            deployment.shutdown()

