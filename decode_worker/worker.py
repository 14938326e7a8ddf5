"""A decode worker: a Ray actor holding an engine that generates, from KV computed elsewhere
or (for short or well-cached prompts) prefilled here.

The ingress sends each request once, with the router's choice of prefill worker, over the
worker's stream (``cluster/protocol/stream.py``: a TCP connection to the address ``open_stream``
gives, which carries the request's messages back), and it runs ``generate``. The worker does the
rest itself:

1. reserves blocks for the prompt, reusing the full blocks it already caches (only the rest
   travel);
2. asks the prefill worker to compute the missing KV and stream it layer by layer, while its
   own receive takes each layer straight into the reserved blocks (with a draft model, where
   ``decode_worker/draft_prompt_kv.py`` chooses, the prefill worker also builds the draft's KV
   of the prompt and sends it after the model's, so the first guess needs no catch-up);
3. admits the request into its continuous batch with the first token the prefill worker
   sampled;
4. streams token deltas back to the caller: each item carries every token produced since the
   caller read the last one (one per step while it keeps up, several when it lags).

With no prefill worker (``prefill=None``) it prefills the prompt itself, first pulling the
prefix a peer decode worker caches where the router chose that (``kv_source``; ``kv.peer_pull``:
``decode_worker/peer_pull.py``). A caller that goes
away closes its connection, which ends the generator and releases the request's blocks (after
its KV receive ends, if one is posted: a receive may still write into them). A prefill worker that dies, or a transfer
that fails, ends the stream with a ``WorkerFailure`` (``cluster/protocol/messages.py``): the
caller can retry elsewhere.

A failed transfer also ends its transfer group: gloo closes a group's connections for good once
one send or receive in it times out, and a receive left posted by a prefill that failed would
time out later. So the worker builds the pair a new group with that prefill worker at once
(both sides join it; requests in flight on the old one end there), and until it is built it
reports the prefill worker as ``unpaired`` in its load, so routers place around the pair.

The engine is stepped by its own thread (``EngineWorker``); calls touch it between steps, on
the actor's event loop when its lock is free and from a small thread pool when a step holds
it, and outputs reach each request's stream through the event loop, once per step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, AsyncIterator

from cluster.engine.config import EngineConfig
from cluster.engine.request import TransferTarget
from cluster.engine.sampling_params import InvalidRequestError
from cluster.worker.engine_worker import EngineWorker
from cluster.protocol.messages import (FailureKind, Finished, PrefillResult, PullReport, RequestFailed, TokenDelta,
                                       TransferReport, Usage, WorkerFailure, WorkerRequest)
from cluster.protocol.stream import StreamServer
from cluster.runtime.short_slice import serve_with_short_slices
from decode_worker.call_overhead import CallOverhead
from decode_worker.peer_pull import TAG_LIMIT, PeerPulls
from decode_worker.draft_prompt_kv import DraftPromptPlacement

if TYPE_CHECKING:
    from cluster.engine.engine import RequestOutput

CALL_THREADS = 4  # reserve, admit, release and status calls: each waits at most one step for the lock
MAX_RECEIVES = 64  # receives in flight: each blocks a thread until its KV has landed
REJOIN_TIMEOUT_S = 30.0  # a rebuilt transfer group's rendezvous: both sides join it at once
REJOIN_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)  # between attempts to rebuild a pair, the last repeated
PAIRING_PINGS = 5  # calls timed when a pair is built: the hop's first samples, before any request


class _Stream:
    """One request's outputs on their way to its caller: appended once per step from the
    engine's thread (through the event loop), taken all at once by the caller."""

    def __init__(self):
        self.parts: list[TokenDelta | RequestFailed] = []
        self.ready = asyncio.Event()
        self.busy: list[asyncio.Future] = []  # calls into the engine (a reserve, a KV receive) still running

    def push(self, part: TokenDelta | RequestFailed) -> None:
        self.parts.append(part)
        self.ready.set()

    async def take(self) -> TokenDelta | RequestFailed:
        await self.ready.wait()
        self.ready.clear()
        parts, self.parts = self.parts, []
        return merge_deltas(parts)


def delta_of(output: RequestOutput) -> TokenDelta | RequestFailed:
    """What the caller needs of one step's output: the new tokens and text, and at the end the
    finish reason and usage, or the error it ended with."""
    if output.finished and output.finish_reason == "error":
        return RequestFailed(output.error_kind or "unavailable", output.error)
    new = len(output.new_token_ids)
    logprobs = None
    if output.logprobs is not None:
        logprobs = list(zip(output.logprobs[-new:] if new else [], (output.top_logprobs or [])[-new:] if new else []))
    end = None
    if output.finished:
        usage = output.usage
        end = Finished(output.finish_reason, Usage(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
                                                   usage.proposed_tokens, usage.accepted_tokens))
    return TokenDelta(list(output.new_token_ids), output.delta_text, logprobs, end=end)


def merge_deltas(parts: list[TokenDelta | RequestFailed]) -> TokenDelta | RequestFailed:
    """Several steps' parts as one, in order; the last one's ending, if it ended."""
    last = parts[-1]
    if len(parts) == 1 or isinstance(last, RequestFailed):
        return last
    logprobs = None
    if any(p.logprobs is not None for p in parts):
        logprobs = [lp for p in parts for lp in (p.logprobs or [])]
    transfer = next((p.transfer for p in reversed(parts) if p.transfer is not None), None)
    pull = next((p.pull for p in reversed(parts) if p.pull is not None), None)
    return TokenDelta([t for p in parts for t in p.token_ids], "".join(p.text for p in parts), logprobs,
                      transfer, last.end, pull)


class DecodeWorker(PeerPulls, EngineWorker):
    prefill_side = False
    role = "decode"

    def __init__(self, config: EngineConfig, registry_url: str | None = None, profile: bool = True,
                 prefill_peers: tuple[str, ...] = ()):
        """``prefill_peers``: the prefill workers it will be paired with (``pair_with``); until
        then it reports them unpaired, so routers have it prefill itself rather than fail."""
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="decode-call")
        self._receives = ThreadPoolExecutor(MAX_RECEIVES, thread_name_prefix="decode-receive")
        self._peers: dict[str, str] = {}  # prefill worker (or peer pulled from) -> the pair we take KV through
        self._pulls_from: set[str] = set()  # of those, the decode peers (kv.peer_pull): pulls, not prefills
        self._tags: dict[str, itertools.count] = {}
        self._groups: dict[str, tuple] = {}  # pair -> (its PairLayout, the GroupSpec of its current group)
        # Prefill workers (and peers) whose pair is not built yet or being rebuilt (read by the reporter's thread).
        self._unpaired: frozenset[str] = frozenset(prefill_peers)
        self._pairing: dict[str, asyncio.Lock] = {}  # prefill worker -> held while its group is (re)built
        self.pair_rebuilds = 0
        self._stream: StreamServer | None = None
        self.prefill_call = CallOverhead()  # its calls to prefill workers beyond their work (read by the reporter)
        self.pulls = {"pulled": 0, "recomputed": 0, "blocks": 0}  # this worker's pulls from peers, by outcome
        self.pull_cost = CallOverhead()  # its pulls from peers, seconds per block (the same median of the latest)
        spec = config.speculative
        self.draft_prompt_kv = DraftPromptPlacement(spec.draft_prompt_kv if spec is not None else "decode")
        super().__init__(config, registry_url, profile)

    # -- set-up -------------------------------------------------------------------------------

    async def set_peers(self, peers: dict[str, str]) -> None:
        """The prefill workers this worker can take KV from, each with the pair joining them
        (a pair already in use keeps its tags: transfers may be in flight on it)."""
        self._peers = {**{w: p for w, p in self._peers.items() if w in self._pulls_from}, **peers}
        self._tags = {pair: self._tags.get(pair) or itertools.count() for pair in peers.values()}

    async def unpair(self, prefill: str) -> None:
        """Takes no KV from ``prefill`` until ``pair_with`` pairs it again (it died: the one
        started in its place has none of the old group), and says so in its report."""
        if prefill in self._peers:
            self._set_unpaired(self._unpaired | {prefill})

    async def pair_with(self, prefill: str, layout, spec) -> None:
        """Builds this worker's transfer group with the prefill worker ``prefill`` (named
        ``spec.name``, rendezvous at the prefill worker's node), both sides at once, and takes KV
        from it through that group from then on. Called on a running worker: by its deployment
        at start, and for a prefill worker (or this worker) started again after it died. Until
        the group is built the pair is out of use (reported as unpaired)."""
        await self._pair(prefill, layout, spec, pulls=False)

    async def pair_with_peer(self, peer: str, layout, spec) -> None:
        """As :meth:`pair_with`, with the decode worker ``peer`` (``kv.peer_pull``): it sends
        (the layout's first ranks, the rendezvous at its node), this worker pulls its cached
        prefixes through the group from then on, and reports it in ``pull_from``."""
        await self._pair(peer, layout, spec, pulls=True)

    async def _pair(self, worker_name: str, layout, spec, pulls: bool) -> None:
        async with self._pairing.setdefault(worker_name, asyncio.Lock()):
            if worker_name in self._peers:
                self._set_unpaired(self._unpaired | {worker_name})
            worker = self.peer_worker(worker_name)
            await asyncio.gather(worker.join_pair.remote(layout, spec, True), self.join_pair(layout, spec, False))
            if not pulls:
                await self._time_calls(worker)
            else:
                self._pulls_from.add(worker_name)
            self._peers[worker_name] = layout.name
            self._tags[layout.name] = itertools.count()  # a new group: no transfer is in flight on it
            self._set_unpaired(self._unpaired - {worker_name})

    async def _time_calls(self, worker) -> None:
        """Samples of the hop to a prefill worker, by calls that do nothing there."""
        for _ in range(PAIRING_PINGS):
            started = time.perf_counter()
            await worker.ping.remote()
            self.prefill_call.add(time.perf_counter() - started)

    async def drop_peer(self, prefill: str) -> None:
        """Takes KV from ``prefill`` (a prefill worker, or a decode peer pulled from) no more,
        forgets it and leaves their transfer group (its deployment removes it, once no request
        of this worker's is being prefilled there)."""
        async with self._pairing.setdefault(prefill, asyncio.Lock()):
            pair = self._peers.pop(prefill, None)
            if pair is not None:
                self._groups.pop(pair, None)
                self._tags.pop(pair, None)
                await self.leave_pair(pair)
            self._pulls_from.discard(prefill)
            self._set_unpaired(self._unpaired - {prefill})

    async def leave_pair(self, pair: str) -> None:
        await asyncio.get_running_loop().run_in_executor(self._receives, super().leave_pair, pair)

    async def in_flight(self) -> int:
        """Requests on this worker's streams now, from their arrival (before their blocks are
        reserved) to their last delta."""
        return len(self._streams)

    async def describe(self) -> dict:
        return await self._call(super().describe)

    async def open_stream(self, token: str) -> str:
        """Starts (once) the server that ingress replicas send requests to, on this node's
        address, accepting connections that present ``token``; returns its address."""
        if self._stream is None:
            import ray

            self._loop = asyncio.get_running_loop()
            serve_with_short_slices()  # this loop's thread takes requests and sends their tokens (the compute threads take theirs in the stepping loop)
            stream = StreamServer(self.generate, token)
            await stream.start(ray.util.get_node_ip_address())
            self._stream = stream
        elif not hmac.compare_digest(token.encode(), self._stream.token.encode()):
            raise ValueError("open_stream: not this cluster's stream token")
        return self._stream.address


    async def join_pair(self, layout, spec, sends: bool | None = None) -> None:
        await asyncio.get_running_loop().run_in_executor(self._receives, super().join_pair, layout, spec, sends)
        self._groups[layout.name] = (layout, spec)

    async def lifetime(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, super().lifetime)

    async def status(self) -> dict:
        return {**await self._call(super().status), "unpaired": sorted(self._unpaired),
                "pair_rebuilds": self.pair_rebuilds, "pull_from": list(self._pull_from()),
                "pulls": dict(self.pulls) if self._pulls_from or any(self.pulls.values()) else None}  # kv.peer_pull

    def _unpaired_prefill(self) -> tuple[str, ...]:
        return tuple(sorted(w for w in self._unpaired if w not in self._pulls_from))

    def _pull_from(self) -> tuple[str, ...]:
        return tuple(sorted(w for w in self._pulls_from if w in self._peers and w not in self._unpaired))

    def _prefill_call_s(self) -> float:
        return self.prefill_call.seconds

    def _pull_s_per_block(self) -> float:
        return self.pull_cost.seconds
    def _draft_prompt_share(self) -> float:
        return self.draft_prompt_kv.share

    # -- a pair whose transfer group failed ------------------------------------------------------

    def _pair_failed(self, prefill: str, spec) -> None:
        """Takes the pair out of use and rebuilds its transfer group in the background, unless
        the transfer that failed used a group already replaced."""
        pair = self._peers[prefill]
        if prefill not in self._unpaired and self._groups[pair][1] is spec:
            self._set_unpaired(self._unpaired | {prefill})
            asyncio.ensure_future(self._rebuild(prefill))

    def _set_unpaired(self, unpaired: frozenset[str]) -> None:
        self._unpaired = unpaired
        if self.reporter is not None:
            self.reporter.report_soon()

    async def _rebuild(self, prefill: str) -> None:
        """Joins a new group with ``prefill`` (a new name, so a new rendezvous port and store
        prefix), both sides at once; tries again after a while until it is built or the prefill
        worker is gone (then routers know it failed, and the pair stays out of use)."""
        import ray

        pair = self._peers[prefill]
        for attempt in itertools.count():
            try:
                async with self._pairing.setdefault(prefill, asyncio.Lock()):
                    if prefill not in self._unpaired:
                        return  # rebuilt meanwhile (``pair_with``: the prefill worker was started again)
                    layout, spec = self._groups[pair]
                    self.pair_rebuilds += 1
                    self.metrics.pair_rebuilt(prefill)
                    base = spec.name.partition(".rebuilt-")[0]
                    new = dataclasses.replace(spec, name=f"{base}.rebuilt-{self.pair_rebuilds}",
                                              timeout_s=REJOIN_TIMEOUT_S)
                    worker = self.peer_worker(prefill)
                    await asyncio.gather(worker.join_pair.remote(layout, new, True), self.join_pair(layout, new, False))
                    self._tags[pair] = itertools.count()
                    self._set_unpaired(self._unpaired - {prefill})
            except (ray.exceptions.RayActorError, ValueError):
                return  # the prefill worker is gone (its deployment pairs the one started in its place)
            except Exception:  # noqa: BLE001 - a rendezvous that failed (a port taken, a side too slow): again
                await asyncio.sleep(REJOIN_BACKOFF_S[min(attempt, len(REJOIN_BACKOFF_S) - 1)])
                continue
            return

    async def free_blocks(self) -> int:
        return await self._call(super().free_blocks)

    async def cached_prefix_blocks(self, prompt_token_ids: list[int]) -> int:
        return await self._call(super().cached_prefix_blocks, prompt_token_ids)

    async def shutdown(self) -> None:
        if self._stream is not None:
            self._stream.close()
        await asyncio.get_running_loop().run_in_executor(None, super().shutdown)
        self._calls.shutdown(wait=False)
        self._receives.shutdown(wait=False)

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._calls, fn, *args)

    # -- one request ---------------------------------------------------------------------------

    async def generate(self, request: WorkerRequest) -> AsyncIterator[TokenDelta | RequestFailed | WorkerFailure]:
        """Runs one request and streams its messages (see the module's docstring). The first
        delta carries ``transfer`` (what the KV hand-off did) when a prefill worker was used,
        ``pull`` when a peer's cached prefix was pulled (``decode_worker/peer_pull.py``); a
        RequestFailed or WorkerFailure (another placement may work) ends the stream."""
        request_id = request.request_id
        self._loop = asyncio.get_running_loop()
        stream = self._streams[request_id] = _Stream()
        ended = False
        try:
            first = await self._start(stream, request)
            if isinstance(first, (RequestFailed, WorkerFailure)):
                ended = True
                yield first
                return
            if first is not None:  # what the KV hand-off (or pull) did, ahead of the first tokens
                stream.parts.insert(0, first)
            while True:
                item = await stream.take()
                ended = item.final
                yield item
                if ended:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not ended:  # the caller went away: free the request's blocks once nothing can still write them
                asyncio.ensure_future(self._release_after(request_id, list(stream.busy)))

    async def _start(self, stream: _Stream, request: WorkerRequest) -> TokenDelta | RequestFailed | WorkerFailure | None:
        """Gets the request into the batch: its KV from the prefill worker, or prefilled here
        (after pulling a peer's cached prefix, where the router chose that). Returns the delta
        that reports the hand-off or pull, None for a plain local prefill, or how it failed."""
        if request.prefill is not None:
            outcome = await self._prefill_remote(stream, request)
            return TokenDelta([], "", transfer=outcome) if isinstance(outcome, TransferReport) else outcome
        if request.kv_source is not None:
            pulled = await self._pull_prefix(stream, request)
            return TokenDelta([], "", pull=pulled) if isinstance(pulled, PullReport) else pulled
        try:
            await self._tracked(stream, self._add_local, request)
        except InvalidRequestError as exc:
            return RequestFailed("invalid", str(exc))
        return None

    async def _tracked(self, stream: _Stream, fn, *args):
        """``fn(*args)`` under the engine's lock: here at once when the lock is free (the engine
        is between steps: a thread hop would cost more than the call), otherwise on a call
        thread, on ``stream.busy``, so that a caller that goes away does not cancel it and the
        request is released only once it has ended."""
        if self._lock.acquire_now():
            try:
                return fn(*args)
            finally:
                self._lock.release()
        call = asyncio.get_running_loop().run_in_executor(self._calls, self._locked, fn, *args)
        stream.busy.append(call)
        return await asyncio.shield(call)

    def _locked(self, fn, *args):
        with self._lock:
            return fn(*args)

    async def _release_after(self, request_id: str, busy: list[asyncio.Future]) -> None:
        """Releases a request once its reserve and KV receive (if any) have ended: a reserve
        that completes after a release would leak its blocks, and a receive still posted may
        write into blocks handed to another request."""
        await asyncio.gather(*busy, return_exceptions=True)
        await self._call(self._release, request_id)

    async def _prefill_remote(self, stream: _Stream,
                              request: WorkerRequest) -> TransferReport | RequestFailed | WorkerFailure:
        """Reserves blocks, then runs the prefill worker's prefill and this worker's receive
        together; admits the request once both ended well. Returns what the hand-off did, or how
        it failed. Its engine calls go on ``stream.busy`` for a cancelled caller's cleanup."""
        import ray

        loop = asyncio.get_running_loop()
        request_id, prefill, timeout_s = request.request_id, request.prefill, request.transfer_timeout_s
        reserved = await self._reserve_blocks(stream, self._reserve, request)
        if not isinstance(reserved, tuple):
            return reserved
        first_block, dst_blocks, draft, catch_up_s = reserved
        pair = self._peers.get(prefill)
        if pair is None or prefill in self._unpaired:
            await self._call(self._release, request_id)
            state = "no" if pair is None else "a rebuilding"
            return WorkerFailure(FailureKind.UNPAIRED, f"{self.name} has {state} KV transfer group with {prefill}",
                                 prefill)
        group = self._groups[pair][1]  # the group this transfer uses (a failure rebuilds only this one)
        from cluster.kv_transfer.sender import TAG_STRIDE  # with torch: not loaded where only the class is

        tag_base = next(self._tags[pair]) * self.engine.transfer_layers * TAG_STRIDE % TAG_LIMIT
        draft_first, draft_blocks = None, None
        if draft is not None and request.params.speculative:
            tokens = len(request.prompt_token_ids) - draft[0] * self.engine.config.block_size
            if self.draft_prompt_kv.choose(prefill, tokens, len(draft[1]), catch_up_s, self.engine.draft.block_bytes):
                draft_first, draft_blocks = draft
        target = TransferTarget(pair, tag_base, first_block, timeout_s, request.stream_layers, draft_first)
        started = time.perf_counter()
        times: dict[str, float] = {}  # wall clock, for the request's trace
        receive_started = time.time()
        receiving = loop.run_in_executor(self._receives, self.engine.receive_transfer, pair, request_id, dst_blocks,
                                         tag_base, timeout_s, draft_blocks)
        stream.busy.append(receiving)
        receiving.add_done_callback(lambda _: times.setdefault("received", time.time()))
        try:
            worker = self.peer_worker(prefill)
            prefill_started, call_started = time.time(), time.perf_counter()
            result: PrefillResult = await worker.prefill.remote(request_id, request.prompt_token_ids, request.params,
                                                                target, request.resumed_tokens)
            prefill_ended = time.time()
            if result.service_s:
                self.prefill_call.add(time.perf_counter() - call_started - result.service_s)
            self.draft_prompt_kv.reported(prefill, result.draft_s_per_token)
        except (ray.exceptions.RayActorError, ValueError):
            # It died (or never was): our receive ends at its deadline, then the blocks go free.
            asyncio.ensure_future(self._release_after(request_id, [receiving]))
            return WorkerFailure(FailureKind.RETRY, f"prefill worker {prefill} died", prefill)
        if result.error:
            # Its receive may stay posted until its deadline: the group is rebuilt rather than
            # waited for, and the blocks go free once the receive has ended.
            self._pair_failed(prefill, group)
            asyncio.ensure_future(self._release_after(request_id, [receiving]))
            return WorkerFailure(FailureKind.UNPAIRED, f"KV transfer failed: prefill: {result.error}", prefill)
        receive_error = await asyncio.shield(receiving)
        received_s = time.perf_counter() - started
        if receive_error:
            self._pair_failed(prefill, group)
            await self._call(self._release, request_id)
            return WorkerFailure(FailureKind.UNPAIRED, f"KV transfer failed: receive: {receive_error}", prefill)
        await self._tracked(stream, self._admit, request_id, result.first_token, result.first_logprob,
                            result.first_top_logprobs, draft_first)
        draft_bytes = len(draft_blocks) * self.engine.draft.block_bytes if draft_blocks is not None else 0
        nbytes = len(dst_blocks) * self.engine.runner.block_bytes + draft_bytes
        self.metrics.received(nbytes, received_s)
        self.draft_prompt_kv.transferred(nbytes, received_s - result.service_s)
        return TransferReport(prefill=prefill, blocks_cached_on_decode=first_block, blocks_sent=result.blocks_sent,
                              prefill_cached_tokens=result.cached_tokens, bytes=nbytes,
                              prefill_span=(prefill_started, prefill_ended),
                              receive_span=(receive_started, times.get("received", prefill_ended)),
                              admitted_at=time.time(), draft_bytes=draft_bytes)

    async def _reserve_blocks(self, stream: _Stream, reserve, request: WorkerRequest
                              ) -> tuple | RequestFailed | WorkerFailure:
        """``reserve(request)`` under the engine's lock: what it reserved (blocks cached here, block ids the KV
        goes to), or how the request failed (invalid; no room now, which another placement may have)."""
        try:
            reserved = await self._tracked(stream, reserve, request)
        except InvalidRequestError as exc:
            return RequestFailed("invalid", str(exc))
        if reserved is None:
            blocks, scheduler = self.engine.block_manager, self.engine.scheduler
            return WorkerFailure(FailureKind.NO_ROOM, f"{self.name} has no free KV blocks for this prompt now "
                                 f"({blocks.num_free_blocks} of {blocks.num_blocks} free; {len(scheduler.running)} "
                                 f"running, {len(scheduler.receiving)} receiving, {len(scheduler.waiting)} waiting)")
        return reserved

    # -- under the engine's lock (``_tracked``) ------------------------------------------------

    def _add_local(self, request: WorkerRequest) -> None:
        self.engine.add_request(request.request_id, request.prompt_token_ids, request.params, request.priority,
                                resumed_tokens=request.resumed_tokens)
        self.arrivals.took(request.request_id)

    def _reserve(self, request: WorkerRequest):
        """(blocks cached here, the blocks the KV goes to, the draft's destination or None, what
        the policy charges a token of draft catch-up), or None when blocks are short."""
        engine = self.engine
        reserved = engine.reserve_transfer(request.request_id, request.prompt_token_ids, request.params,
                                           request.priority, resumed_tokens=request.resumed_tokens)
        if reserved is None:
            return None
        self.arrivals.took(request.request_id)
        return (*reserved, engine.draft_destination(request.request_id), engine.draft_catch_up_s_per_token())

    def _admit(self, request_id: str, first_token: int, logprob, top_logprobs, draft_first_block: int | None) -> None:
        self._on_outputs([self.engine.admit_transfer(request_id, first_token, logprob, top_logprobs,
                                                     draft_first_block)])

    # -- on the call threads (the engine under its lock) ---------------------------------------

    def _release(self, request_id: str) -> None:
        with self._lock:
            self.engine.abort_request(request_id)

    # -- the stepping thread ------------------------------------------------------------------

    def _has_work(self) -> bool:
        # Requests still receiving their KV are not schedulable yet; host-tier loads are taken in by a step.
        return bool(self.engine.scheduler.running or self.engine.scheduler.waiting) or self.engine.loads_in_flight

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        parts = [(o.request_id, delta_of(o)) for o in outputs if o.request_id in self._streams]
        if parts and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, parts)

    def _deliver(self, parts: list[tuple[str, TokenDelta | RequestFailed]]) -> None:
        for request_id, part in parts:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.push(part)

