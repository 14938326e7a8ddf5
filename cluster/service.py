"""The cluster as a service: one Ray actor, named ``frontend``, that owns the driver of a
disaggregated deployment and steps it on a thread of its own, while the gRPC ingress streams
requests in and tokens out through it.

Calls arrive on the actor's event loop; the driver is touched only by the stepping thread, so
requests and cancellations cross over through a queue of commands, and outputs come back to
each request's asyncio queue with ``call_soon_threadsafe``. A ``generate`` call is a Ray
streaming generator: each item is a plain dict (a delta of tokens, the final usage and
timings, or an error with its kind). A caller that goes away (cancelled, disconnected, past
its deadline) closes the generator, and the request is aborted on every worker.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import sys
import threading
import time
from typing import AsyncIterator

from cluster.engine.engine import RequestOutput
from cluster.engine.sampling_params import InvalidRequestError, SamplingParams
from cluster.metrics import ClusterMetrics
from cluster.request_limits import quote
from cluster.topology import ClusterSpec, parse_topology

STATUS_TIMEOUT_S = 10.0


def _resolve_registry_url(spec: ClusterSpec) -> str | None:
    url = spec.registry.url
    if url and spec.registry.password_env:
        password = os.environ.get(spec.registry.password_env)
        if password is None:
            raise InvalidRequestError(f"registry.password_env: environment variable {spec.registry.password_env} "
                                      "is not set")
        scheme, _, rest = url.partition("://")
        url = f"{scheme}://:{password}@{rest.rpartition('@')[2]}"
    return url


def build_driver(spec: ClusterSpec, verbose: bool = True):
    """The deployment's driver: workers in their placement groups, registry, router."""
    from cluster.disaggregated import DisaggregatedLLM, PoolResources
    from cluster.startup import TOPOLOGY_SETTINGS

    def pool(role: str) -> PoolResources:
        p = getattr(spec, role)
        return PoolResources(p.cpus_per_rank, p.gpus_per_rank, tuple(sorted(dict(p.node.resources).items())))

    role_args = {role: spec.engine_args(role) for role in ("prefill", "decode")}
    for args in role_args.values():
        args.pop("cluster_name", None)
    device = role_args["decode"].pop("device", "cpu")
    role_args["prefill"].pop("device", None)
    return DisaggregatedLLM(
        str(spec.model_dir()), verbose=verbose, prefill_tp=spec.prefill.tp, decode_tp=spec.decode.tp,
        prefill_workers=spec.prefill.replicas, decode_workers=spec.decode.replicas, cluster_name=spec.name,
        ray_address=spec.ray.address, transfer_timeout_s=spec.kv.transfer_timeout_s, kv_transport=spec.kv.transport,
        stream_layers=spec.kv.stream_layers, router_config=spec.router, registry_url=_resolve_registry_url(spec),
        pools={"prefill": pool("prefill"), "decode": pool("decode")}, role_args=role_args, device=device,
        settings=TOPOLOGY_SETTINGS,
    )


class ClusterService:
    def __init__(self, spec_yaml: str):
        self.spec = parse_topology(spec_yaml)
        self.llm = build_driver(self.spec)
        self.model_name = self.spec.model.name or self.spec.model_dir().name
        self.metrics = ClusterMetrics(self.spec.name, self.spec.router.policy)
        self._slo_read_at = 0.0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="driver", daemon=True)
        self._thread.start()

    # -- the stepping thread ----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if not self.llm.has_unfinished_requests():
                time.sleep(0.002)
                continue
            try:
                outputs = self.llm.step()
            except Exception as exc:  # noqa: BLE001 - the service must outlive a bad step
                print(f"[tandem] driver step failed: {exc!r}", file=sys.stderr, flush=True)
                time.sleep(0.1)
                continue
            for output in outputs:
                self._deliver(output)
            self.metrics.queue_length(len(self.llm.engine.queue))
            if time.monotonic() - self._slo_read_at > 5.0:
                self._slo_read_at = time.monotonic()
                self.metrics.slo(self.llm.goodput())

    def _drain_commands(self) -> None:
        while True:
            try:
                command, args = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                request_id, prompt, params, priority, slo_class, ttft_s, tpot_s = args
                try:
                    self.llm.engine.add_request(request_id, prompt, params, priority, slo_class, stream=True,
                                                ttft_s=ttft_s, tpot_s=tpot_s)
                except InvalidRequestError as exc:
                    self._send(request_id, {"error": {"kind": "invalid", "message": str(exc)}, "finished": True})
            elif command == "abort":
                output = self.llm.abort(args)
                if output is not None:
                    self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        message = {"token_ids": list(output.new_token_ids), "text": output.delta_text, "finished": output.finished}
        if output.logprobs is not None:
            new = len(output.new_token_ids)
            message["logprobs"] = list(zip(output.logprobs[-new:] if new else [],
                                           (output.top_logprobs or [])[-new:] if new else []))
        if output.finished:
            decision = self.llm.decisions.pop(output.request_id, None)
            self.metrics.finished(output, decision.slo_class if decision is not None else "")
            if decision is not None:
                message["placement"] = [decision.prefill or "", decision.decode or ""]
            if output.finish_reason == "error":
                message["error"] = {"kind": output.error_kind or "unavailable", "message": output.error}
            message["finish_reason"] = output.finish_reason
            message["usage"] = [output.usage.prompt_tokens, output.usage.cached_tokens, output.usage.completion_tokens]
            message["timings"] = _timings(output)
        self._send(output.request_id, message)

    def _send(self, request_id: str, message: dict) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, message)

    # -- calls --------------------------------------------------------------------------------

    async def generate(self, request: dict) -> AsyncIterator[dict]:
        """Streams one request's messages; ``request`` has prompt (text or token ids),
        sampling (a mapping of SamplingParams fields), slo_class, ttft_s, tpot_s, priority and
        an optional request_id and model."""
        request_id = request.get("request_id") or f"req-{next(self._ids)}"
        model = request.get("model")
        if model and model != self.model_name:
            message = f"model {quote(model)} is not served here; this cluster serves {quote(self.model_name)}"
            yield {"error": {"kind": "not_found", "message": message}, "finished": True}
            return
        if request_id in self._streams:
            yield {"error": {"kind": "invalid", "message": f"request_id {quote(request_id)} is already in flight"},
                   "finished": True}
            return
        try:
            params = SamplingParams.from_mapping(request.get("sampling") or {})
        except InvalidRequestError as exc:
            yield {"error": {"kind": "invalid", "message": str(exc)}, "finished": True}
            return
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._commands.put(("add", (request_id, request["prompt"], params, int(request.get("priority") or 0),
                                    request.get("slo_class") or None, request.get("ttft_s"), request.get("tpot_s"))))
        finished = False
        try:
            first = True
            while True:
                message = await q.get()
                if first:
                    message["request_id"] = request_id
                    first = False
                yield message
                if message.get("finished"):
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def model_info(self) -> dict:
        engine = self.llm.engine
        limits = engine.limits
        router = self.spec.router
        return {"name": self.model_name, "architecture": self.llm.architecture, "max_model_len": limits.max_model_len,
                "vocab_size": engine.vocab_size, "block_size": limits.block_size,
                "has_tokenizer": engine.tokenizer is not None, "slo_classes": [c.name for c in router.slo_classes],
                "default_slo_class": router.default_class}

    def tokenize(self, text: str) -> list[int]:
        if self.llm.engine.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer.json; send token ids")
        return self.llm.engine.tokenizer.encode(text)

    def detokenize(self, token_ids: list[int]) -> str:
        engine = self.llm.engine
        if engine.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer.json")
        bad = [t for t in token_ids if not 0 <= t < engine.vocab_size]
        if bad:
            raise InvalidRequestError(f"token_ids must be in [0, {engine.vocab_size}); got {quote(bad[:5])}")
        return engine.tokenizer.decode(token_ids)

    async def status(self) -> dict:
        """Every worker (role, TP, state, KV blocks, queue, hit rate), the router, goodput. Its
        calls wait on other actors, so they run off the event loop that streams tokens."""
        return await asyncio.to_thread(self._status)

    def _status(self) -> dict:
        return {"cluster": self.spec.name, "model": self.model_name, "workers": self.llm.worker_status(),
                "router": self.llm.router_status(), "goodput": self.llm.goodput(),
                "queued": len(self.llm.engine.queue), "in_flight": len(self._streams)}

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.llm.shutdown()

    def ready(self) -> bool:
        return self._thread.is_alive()


def _timings(output: RequestOutput) -> list[float]:
    """[queue, TTFT, TPOT, end to end] in milliseconds (0 where unknown)."""
    def ms(later: float | None, earlier: float | None) -> float:
        return (later - earlier) * 1000 if later is not None and earlier is not None else 0.0

    n = output.usage.completion_tokens
    tpot = ms(output.finish_time, output.first_token_time) / (n - 1) if n >= 2 else 0.0
    return [ms(output.scheduled_time, output.arrival_time), ms(output.first_token_time, output.arrival_time), tpot,
            ms(output.finish_time, output.arrival_time)]
