"""One request's path through the cluster, as an ingress replica (or ``tandem run``) drives it.

    call ──▶ validate, tokenize ──▶ router.place ──▶ decode worker.generate ──▶ token items ──▶ call
                                     (in this process)  (1 request on the worker's stream; it
                                                         fetches the KV from the prefill worker)

One hop on the critical path, whatever the cluster's size: this replica's own router
(``router/service.py``) answers where the request goes (at once, or when it can be placed)
without leaving the process, and the chosen decode worker streams the tokens straight back
here over a connection kept open to it (``cluster/protocol/stream.py``). Nothing else sees the
request.

When a worker fails under a request it moves, up to ``router.migration_limit`` times: a
decode worker that dies mid-stream is told to the router, and the prompt plus the tokens
already streamed are placed and prefilled elsewhere (its prefix cache helps), the stream
resuming without repeating or losing a token; a prefill worker that dies before the KV lands,
or a transfer that fails, is retried on another placement. Only when no worker of a role is
left does the caller get ``unavailable``.

Messages are typed (``cluster/protocol/messages.py``; the API layers turn them into gRPC or
HTTP responses): an ``Output`` per token delta, the first carrying ``request_id`` and the first
of each placement ``placement`` (prefill worker, decode worker); the last also ``end``: how it
finished (reason and usage: prompt, cached, completion), its timings (queue, TTFT, TPOT, end to
end, in ms), the decision and transfer, and ``router_told`` (a future settled once the router
has its record, for a caller that reads goodput next: the router is told after the last message
is handed over); or a ``RequestFailed`` with kind ``invalid``, ``not_found``, ``rejected`` or
``unavailable``. Times count from ``arrival``, when the call reached the API.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Sequence

from cluster.protocol.messages import (ApiRequest, Ending, FailureKind, Finished, Output, PullReport, RequestFailed,
                                       ServingInfo, Timings, TokenDelta, TransferReport, Usage, WorkerFailure,
                                       WorkerRequest)
from cluster.engine.block_manager import BlockManager
from cluster.engine.prompt import prompt_token_ids
from cluster.engine.request import Request
from cluster.engine.sampling_params import InvalidRequestError, SamplingParams
from cluster.engine.scheduler import Scheduler
from cluster.engine.structured.grammars import check as check_structured
from cluster.engine.tokenizer import Tokenizer, TokenizerError
from cluster.engine.tool_calls.formats import ToolCalling, tool_calling
from cluster.engine.request_limits import (check_priority, check_request_id, check_slo_class, check_stop_token_ids,
                                           quote)
from cluster.protocol.stream import StreamClient, WorkerGone
from router.config import RouterConfigError
from router.router import Decision, RouteRequest
from router.service import RouterService

NO_ROOM_RETRIES = 50  # a decode worker that had no blocks after all: placements tried again, with a short wait


@dataclass
class Attempt:
    """One placement of a request and what came of it (a request that moved has several)."""

    requested_at: float
    decided_at: float
    decision: Decision
    transfer: TransferReport | None = None  # the decode worker's report of the KV hand-off, with its times
    first_token_at: float | None = None
    tokens: int = 0
    ended_at: float | None = None
    failure: str | None = None
    placed_at: float | None = None  # when the request path took the placement up
    proposed_tokens: int = 0  # speculative guesses the decode worker checked, and kept (as it reported at the end)
    accepted_tokens: int = 0
    pull: PullReport | None = None  # the decode worker's report of its pull of a peer's cached prefix


@dataclass
class Journey:
    """What happened to one request, for its last message, its metrics and the router."""

    request_id: str
    arrival: float
    prompt_tokens: int
    slo_class: str = ""
    placed_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    attempt: int = 0  # placements after the first (migrations and retries)
    decision: Decision | None = None
    transfer: TransferReport | None = None
    pull: PullReport | None = None  # the last pull of a peer's cached prefix (the placement that made it)
    outcome: str = ""
    checked_at: float | None = None
    attempts: list[Attempt] = field(default_factory=list)

    def ttft_s(self) -> float | None:
        return self.first_token_at - self.arrival if self.first_token_at is not None else None

    def tpot_s(self) -> float | None:
        n = len(self.tokens)
        if n < 2 or self.first_token_at is None or self.finished_at is None:
            return None
        return (self.finished_at - self.first_token_at) / (n - 1)

    def steady_tpot_s(self) -> float | None:
        """Its TPOT where it streamed from one placement, else None: a request moved mid-stream
        counts its worker's failure and the move in its TPOT, which no step time explains. (The
        router learned its TPOT scale from the 8 streams a killed decode worker moved, and then
        predicted 251 ms TPOT where 8 ms held: a burst of 64 right after, 23 and 49 placed; now 64.)"""
        return self.tpot_s() if self.attempt == 0 else None

    def timings_ms(self) -> Timings:
        def ms(later, earlier):
            return (later - earlier) * 1000 if later is not None and earlier is not None else 0.0

        tpot = self.tpot_s()
        return Timings(queue_ms=ms(self.placed_at, self.arrival), ttft_ms=ms(self.first_token_at, self.arrival),
                       tpot_ms=tpot * 1000 if tpot is not None else 0.0, e2e_ms=ms(self.finished_at, self.arrival))


def cached_prompt_tokens(journey: Journey, finished: Finished) -> int:
    """The prompt tokens the request's last placement did not compute (its ``cached_tokens``):
    where a prefill worker computed the prompt, its own cache's hits (blocks the decode worker
    held already spared only their transfer, not their computation); else the decode worker's
    hits, in either tier or pulled from a peer."""
    last = journey.attempts[-1] if journey.attempts else None
    if last is not None and last.transfer is not None:
        return last.transfer.prefill_cached_tokens
    return finished.usage.cached_tokens


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed the checks, in the terms the rest of its path uses."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    slo_class: str
    ttft_s: float | None
    tpot_s: float | None


@dataclass
class AttemptEnd:
    """How one placement's stream ended: ``done`` when the request is over (finished, or an
    error its caller gets), else why another placement is tried."""

    ended: bool = False  # the stream ended (not cut off by its caller going away)
    done: bool = False
    failure: str | None = None
    failed_worker: str | None = None  # a worker found dead
    no_room: bool = False  # the decode worker had no blocks at that moment
    unpaired: str | None = None  # a prefill worker the decode worker cannot take KV from now


class RequestPath:
    def __init__(self, info: ServingInfo, metrics=None, api: str = "grpc", tracer=None, router_name: str = "router-0"):
        """Call ``start()`` on the event loop the requests will run on before the first one."""
        import ray

        self.ray = ray
        self.info = info
        self.metrics = metrics
        self.api = api
        # The offline API (``DisaggregatedLLM.generate``) answers every prompt it is given, as an
        # engine's ``generate`` does: its requests are ranked by their class's objectives but
        # never refused by admission control, only held for room. Refused, an offline batch on
        # a busy machine (4 processes on 2 cores) lost prompts to "predicted to wait 5171 ms more".
        self.refuses = api != "offline"
        self.tracer = tracer  # cluster.ingress.tracing.RequestTracer: each request's trace, when tracing is on
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(info.model_dir)
        except TokenizerError:
            self.tokenizer = None
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        self.tool_calling: ToolCalling = tool_calling(info.tool_call_format, template and template.source,
                                                      bool(template and template.knows_tools))
        self.limits = Scheduler(BlockManager(info.num_blocks, info.block_size), 1, 1, info.max_model_len)
        self.router = RouterService(info.cluster, info.registry_url, info.router_topology, info.router_config,
                                    router_name)
        self._workers: dict[str, object] = {}
        for name in info.decode + info.colocated:
            try:
                self.worker(name)
            except LookupError:
                pass  # gone already: a placement on it fails like one on a worker that died later
        self.streams = StreamClient(info.stream_token)
        self._addresses: dict[str, str] = {}  # generating worker -> its stream's address
        self._address_incarnation: dict[str, str] = {}  # ... and the worker's incarnation when it was looked up
        self.active: dict[str, Journey] = {}

    async def start(self) -> None:
        """Starts the router's work off the critical path, on the loop requests run on, and
        looks up the generating workers' stream addresses (so no first request waits for it)."""
        await self.router.start()
        await asyncio.gather(*(self.stream_address(name) for name in self.info.decode + self.info.colocated),
                             return_exceptions=True)

    async def stop(self) -> None:
        self.streams.close()
        await self.router.stop()

    async def stream_address(self, name: str) -> str:
        """Where the named generating worker takes requests (one Ray call, the first time, and
        again once the registry shows it started again under its name: its handle and stream
        are the new worker's)."""
        incarnation = self.router.incarnation(name)
        if self._address_incarnation.get(name, incarnation) != incarnation:
            self.forget_worker(name)
        address = self._addresses.get(name)
        if address is None:
            address = self._addresses[name] = await self.worker(name).open_stream.remote(self.info.stream_token)
            self._address_incarnation[name] = incarnation
        return address

    def forget_worker(self, name: str) -> None:
        """Drops a worker's handle and stream (it died): the next lookup finds whatever runs
        under its name."""
        self._workers.pop(name, None)
        self._address_incarnation.pop(name, None)
        address = self._addresses.pop(name, None)
        if address is not None:
            self.streams.forget(address)

    def worker(self, name: str):
        """The named worker's handle (LookupError when no such actor lives)."""
        handle = self._workers.get(name)
        if handle is None:
            try:
                handle = self._workers[name] = self.ray.get_actor(name, namespace=self.info.cluster)
            except ValueError:
                raise LookupError(f"worker {name} is not running") from None
        return handle

    # -- checking a request -------------------------------------------------------------------

    def check(self, request: ApiRequest) -> CheckedRequest:
        """The request, checked; InvalidRequestError names what is wrong, LookupError a model this cluster does not serve."""
        model = request.model
        if model and model != self.info.model_name:
            raise LookupError(f"model {quote(model)} is not served here; this cluster serves "
                              f"{quote(self.info.model_name)}")
        request_id = request.request_id or uuid.uuid4().hex
        check_request_id(request_id)
        if request_id in self.active:
            raise InvalidRequestError(f"request_id {quote(request_id)} is already in flight")
        check_slo_class(request.slo_class or None)
        check_priority(int(request.priority or 0))
        token_ids = prompt_token_ids(request.prompt, self.tokenizer, self.info.vocab_size)
        sampling = request.sampling
        if not isinstance(sampling, SamplingParams):
            sampling = dict(sampling or {})
            if "max_tokens" not in sampling and request.max_tokens_to_context:
                sampling["max_tokens"] = max(1, self.room_for(len(token_ids)))  # OpenAI chat: as long as it fits
            sampling = SamplingParams.from_mapping(sampling)
        params = sampling
        check_stop_token_ids(params.stop_token_ids, self.info.vocab_size)
        if params.structured is not None:  # refused here, before routing, rather than by a worker
            check_structured(params.structured)
        self.limits.check(Request(request_id, token_ids, params))
        try:
            cls = self.info.router_config.slo_class(request.slo_class or None)
        except RouterConfigError as exc:
            raise InvalidRequestError(str(exc)) from None
        objectives = (request.ttft_s, request.tpot_s)
        for name, value in zip(("ttft", "tpot"), objectives):
            if value is not None and not value > 0:
                raise InvalidRequestError(f"objectives.{name}_ms must be positive, got {value * 1000:g}")
        return CheckedRequest(request_id, token_ids, params, int(request.priority or 0), cls.name, *objectives)

    def room_for(self, prompt_tokens: int) -> int:
        """Most tokens a prompt this long may generate: to the end of the context, and no more
        than the smallest generating worker's KV cache holds."""
        info = self.info
        return min(info.max_model_len, info.num_blocks * info.block_size) - prompt_tokens

    # -- one request --------------------------------------------------------------------------

    async def generate(self, request: ApiRequest) -> AsyncIterator[Output | RequestFailed]:
        """Streams one request's messages (see the module's docstring). ``request.api`` names
        the API it came through, for metrics (default: this path's)."""
        arrival = min(request.arrival or time.time(), time.time())
        try:
            checked = self.check(request)
        except LookupError as exc:
            yield RequestFailed("not_found", str(exc))
            return
        except InvalidRequestError as exc:
            yield RequestFailed("invalid", str(exc))
            return
        request_id = checked.request_id
        journey = self.active[request_id] = Journey(request_id, arrival, len(checked.prompt_token_ids),
                                                    checked.slo_class, checked_at=time.time())
        first = True
        run = self._run(journey, checked)
        try:
            async for message in run:
                if first:
                    message = replace(message, request_id=request_id)
                    first = False
                yield message
        finally:
            await run.aclose()  # closed now, not when collected: its cleanup frees the request everywhere
            del self.active[request_id]
            if not journey.outcome:
                journey.outcome = "abort"  # the caller went away: _run's own cleanup released the request
            self._account(journey, request)

    def _account(self, journey: Journey, request: ApiRequest) -> None:
        """A request's metrics and trace, once it is over."""
        api = self.api if request.api is None else request.api
        if self.metrics is not None:
            self.metrics.finished(journey.outcome, journey.slo_class, journey.ttft_s(), journey.tpot_s(), api)
        if self.tracer is not None:
            self.tracer.record(journey, api, request.traceparent, time.time())

    async def _run(self, journey: Journey, checked: CheckedRequest) -> AsyncIterator[Output | RequestFailed]:
        """Places the request and streams it, placing it again (up to ``router.migration_limit``
        times) when a worker fails under it."""
        limit = self.info.router_config.migration_limit
        engine_priority = checked.priority + self.info.router_config.slo_class(checked.slo_class).priority
        no_room = placements = 0
        avoid: list[tuple[str, str]] = []  # (prefill, decode) pairs whose KV transfer failed under this request
        while True:
            # Each placement has an id of its own: a word about an earlier one (forget, finished)
            # may reach the router after a later placement was asked for.
            attempt_id = journey.request_id if not placements else f"{journey.request_id}.{placements}"
            placements += 1
            # After a failure mid-stream the tokens already sent become part of the prompt.
            sent = journey.tokens
            params = checked.params
            request = WorkerRequest(
                request_id=attempt_id, prompt_token_ids=checked.prompt_token_ids + sent,
                params=replace(params, max_tokens=params.max_tokens - len(sent)) if sent else params,
                priority=engine_priority, transfer_timeout_s=self.info.transfer_timeout_s,
                stream_layers=self.info.stream_layers, resumed_tokens=len(sent),
                pull_timeout_s=self.info.pull_timeout_s)
            placed = await self._place(journey, checked, request, avoid)
            if isinstance(placed, RequestFailed):
                yield placed
                return
            decision = placed.decision
            request = replace(request, prefill=decision.prefill, kv_source=decision.kv_source,
                              kv_source_blocks=decision.kv_source_blocks)
            end = AttemptEnd()
            async with aclosing(self._stream_attempt(journey, placed, request, end)) as messages:
                async for message in messages:
                    yield message
            if end.done:
                return
            if end.unpaired:
                avoid.append((end.unpaired, decision.decode))
            why = end.failure or f"decode worker {decision.decode} ended the stream early"
            self.router.forget(attempt_id)
            if end.failed_worker is not None:
                if self.metrics is not None:
                    self.metrics.worker_failed(end.failed_worker)
                self.router.worker_failed(end.failed_worker)
            elif end.no_room and no_room < NO_ROOM_RETRIES:
                no_room += 1
                await asyncio.sleep(0.01 * no_room)
                continue
            if self.metrics is not None and journey.attempt < limit:
                self.metrics.migrated("worker_failed" if end.failed_worker else "retry")
            journey.attempt += 1
            if journey.attempt > limit:
                journey.outcome = "unavailable"
                yield RequestFailed("unavailable", f"{why}; gave up after {limit} retries (router.migration_limit)")
                return

    async def _place(self, journey: Journey, checked: CheckedRequest, request: WorkerRequest,
                     avoid: list[tuple[str, str]]) -> Attempt | RequestFailed:
        """Asks the router where this placement goes: its Attempt, or the error that ends the
        request (the router failed, or rejected it)."""
        requested_at = time.time()
        # Generation ends at the model's context whatever max_tokens says (as in the engine):
        # the router plans blocks for the tokens that can come, not for room that never will.
        prompt = request.prompt_token_ids
        planned = min(request.params.max_tokens, self.info.max_model_len - len(prompt))
        # A request placed again (its worker failed under it) is judged from now: the time it
        # already spent was the cluster's doing, and refusing it for that would cut its stream.
        arrival = journey.arrival if not journey.attempts else requested_at
        try:  # a caller that goes away while it waits cancels this: the router drops it
            decision: Decision = await self.router.place(RouteRequest(
                request_id=request.request_id, prompt_token_ids=prompt, max_tokens=planned,
                slo_class=journey.slo_class, ttft_s=checked.ttft_s, tpot_s=checked.tpot_s,
                priority=checked.priority, arrival=arrival, avoid=tuple(avoid),
                admitted=bool(journey.attempts) or not self.refuses))
        except Exception as exc:  # noqa: BLE001 - a fault of the router's own: one line to the caller
            journey.outcome = "unavailable"
            return RequestFailed("unavailable", f"the router failed to place the request: {str(exc).splitlines()[0]}")
        attempt = Attempt(requested_at, time.time(), decision)
        journey.attempts.append(attempt)
        if decision.action == "reject":
            journey.outcome = "rejected"
            if decision.decode is None and decision.reason.startswith("no live"):
                journey.outcome = "unavailable"
                return RequestFailed("unavailable", decision.reason)
            return RequestFailed("rejected", f"rejected by admission control: {decision.reason}",
                                 retry_after_s=decision.retry_after_s)
        journey.decision = decision
        attempt.placed_at = time.time()
        if journey.placed_at is None:
            journey.placed_at = attempt.placed_at
        return attempt

    async def _stream_attempt(self, journey: Journey, attempt: Attempt, request: WorkerRequest,
                              end: AttemptEnd) -> AsyncIterator[Output | RequestFailed]:
        """One placement's stream from its decode worker, as messages to the caller; ``end``
        says how it ended. Its cleanup (closing the stream, telling the router of one left
        unfinished) runs when it ends, however it ends."""
        decision, attempt_id, router = attempt.decision, request.request_id, self.router
        placement = (decision.prefill or "", decision.decode or "")
        placement_sent = False
        stream = None
        try:
            address = await self.stream_address(decision.decode)
            stream = self.streams.generate(address, request)
            async for item in stream:
                if isinstance(item, (RequestFailed, WorkerFailure)):
                    attempt.ended_at, attempt.failure = time.time(), item.message
                    end.ended = True
                    if isinstance(item, RequestFailed):
                        end.done = True
                        router.finished(attempt_id, ttft_s=None, tpot_s=None, failed=True)
                        journey.outcome = item.kind
                        yield RequestFailed(item.kind, item.message)
                        return
                    end.failure, end.failed_worker = item.message, item.failed_worker
                    end.no_room, end.unpaired = item.kind is FailureKind.NO_ROOM, item.unpaired
                    break
                self._record_delta(journey, attempt, item)
                message = Output(item.token_ids, item.text, item.logprobs,
                                 placement=None if placement_sent else placement)
                placement_sent = True  # the caller learns where its request runs with its first tokens
                if item.end is not None:
                    end.ended = end.done = True
                    told = asyncio.get_running_loop().create_future()
                    message = self._finish(journey, item.end, message, told)
                    attempt.ended_at = journey.finished_at
                    try:
                        yield message
                    finally:  # after the last message is on its way
                        router.finished(attempt_id, ttft_s=journey.ttft_s(), tpot_s=journey.steady_tpot_s(),
                                        service_ttft_s=_service_ttft(journey, attempt),
                                        output_tokens=attempt.tokens)
                        told.set_result(None)
                    return
                if message.token_ids or message.text or message.placement is not None:
                    yield message
        except (WorkerGone, self.ray.exceptions.RayActorError, LookupError):
            end.failure, end.failed_worker = f"decode worker {decision.decode} died", decision.decode
            self.forget_worker(decision.decode)
            end.ended = True
        finally:
            if attempt.ended_at is None:
                attempt.ended_at = time.time()
                attempt.failure = end.failure or (None if end.ended else "the caller went away")
            if stream is not None:  # unfinished (cancelled, disconnected, past its deadline): the
                await stream.aclose()  # worker sees its connection close and releases the request
                if not end.ended:
                    router.finished(attempt_id, ttft_s=None, tpot_s=None)

    @staticmethod
    def _record_delta(journey: Journey, attempt: Attempt, item: TokenDelta) -> None:
        """A delta's tokens and times, on the request's journey and its attempt."""
        if item.transfer is not None:
            journey.transfer = attempt.transfer = item.transfer
        if item.pull is not None:
            journey.pull = attempt.pull = item.pull
        if item.token_ids and attempt.first_token_at is None:
            attempt.first_token_at = time.time()
            if journey.first_token_at is None:
                journey.first_token_at = attempt.first_token_at
        journey.tokens.extend(item.token_ids)
        attempt.tokens += len(item.token_ids)
        if item.end is not None:
            attempt.proposed_tokens = item.end.usage.proposed_tokens
            attempt.accepted_tokens = item.end.usage.accepted_tokens

    @staticmethod
    def _finish(journey: Journey, finished: Finished, message: Output, told: asyncio.Future) -> Output:
        """The last message: how the request finished (as this path counts it), its times and
        where it ran; ``told`` settles once the router has the request's record."""
        journey.finished_at = time.time()
        journey.outcome = finished.finish_reason or "stop"
        journey.cached_tokens = min(cached_prompt_tokens(journey, finished), journey.prompt_tokens)
        decision = journey.decision
        usage = Usage(prompt_tokens=journey.prompt_tokens, cached_tokens=journey.cached_tokens,
                      completion_tokens=len(journey.tokens), proposed_tokens=finished.usage.proposed_tokens,
                      accepted_tokens=finished.usage.accepted_tokens)
        ending = Ending(finished=Finished(journey.outcome, usage), timings=journey.timings_ms(), decision=decision,
                        transfer=journey.transfer, migrations=journey.attempt, router_told=told, pull=journey.pull)
        return replace(message, placement=(decision.prefill or "", decision.decode or ""), end=ending)

    # -- the other calls ----------------------------------------------------------------------

    def model_info(self) -> dict:
        info, config = self.info, self.info.router_config
        return {"name": info.model_name, "architecture": info.architecture, "max_model_len": info.max_model_len,
                "vocab_size": info.vocab_size, "block_size": info.block_size,
                "has_tokenizer": self.tokenizer is not None,
                "has_chat_template": self.tokenizer is not None and self.tokenizer.chat_template is not None,
                "slo_classes": [c.name for c in config.slo_classes],
                "default_slo_class": config.default_class}

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer.json; send token ids")
        return self.tokenizer.encode(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer.json")
        bad = [t for t in token_ids if not 0 <= t < self.info.vocab_size]
        if bad:
            raise InvalidRequestError(f"token_ids must be in [0, {self.info.vocab_size}); got {quote(bad[:5])}")
        return self.tokenizer.decode(list(token_ids))


def _service_ttft(journey: Journey, attempt) -> float | None:
    """TTFT counted from the request's placement: what the router learns its correction from;
    None where a pull of a peer's prefix failed (it waited for a peer that never sent, up to
    ``kv.pull_timeout_s``, which no step time explains: one such wait of 3 s taught the local
    path's correction enough that the next pull lost to a prefill worker's whole prompt)."""
    first, placed_at = journey.first_token_at, attempt.placed_at
    if attempt.pull is not None and attempt.pull.error is not None:
        return None
    return first - placed_at if first is not None and first >= placed_at else None
