"""Pulls of a cached prefix between decode workers (``kv.peer_pull``): both sides, as a part of
:class:`~decode_worker.worker.DecodeWorker`.

The router may place a request on a decode worker that prefills it itself after pulling the
prompt's leading blocks a peer caches (``WorkerRequest.kv_source``, ``router/peer_pull.py``).
The receiving worker then

1. reserves the prompt's first ``kv_source_blocks`` blocks (those it caches itself are reused
   and do not travel: ``LLMEngine.reserve_pull``);
2. asks the peer (:class:`~cluster.protocol.messages.PullRequest`, a Ray call to ``offer_pull``),
   which pins the blocks it caches past those (host-tier ones loaded back first), answers how
   many with a :class:`~cluster.protocol.messages.PullOffer` and sends them over their pair from
   every TP rank, unpinning them once sent or failed;
3. receives that many into its reserved blocks, and admits the request with what arrived
   (``LLMEngine.admit_pull``): the rest of the prompt, and every block that did not arrive, is
   computed by its next steps.

Every way a pull can fail ends in step 3 with nothing received, so the request is recomputed,
never lost: a peer that is dead (the call fails), stalled (no answer by ``pull_timeout_s``; a
peer that answers later finds the ask past its deadline and sends nothing), or dies or stalls
mid-send (the receive ends at the deadline). A receive that failed, or an answer that never
came, may have left its pair's group unusable (gloo closes a group whose send or receive timed
out): the pair is taken out of use, reported so (``WorkerLoad.pull_from`` leaves it out), and
rebuilt in the background as a prefill pair is.

A pull that arrived gives a sample of what a block costs to pull, its receive (from the offer to
the last block) over its blocks: the worker reports the median of its latest
(``WorkerLoad.pull_s_per_block``), and the router prices its next pulls by it instead of its
default. The ask's round trip before the offer is not in it, as a remote prefill's call is in
``prefill_call_s``: the cost model has no fixed cost per pull yet.
"""

from __future__ import annotations

import asyncio
import time

from cluster.protocol.messages import PullOffer, PullReport, PullRequest, RequestFailed, WorkerFailure, WorkerRequest

TAG_LIMIT = 2**30


class PeerPulls:
    """The pull's two sides; the worker holds the pairs (``_peers``, ``_pulls_from``) and the
    engine, its lock and its thread pools."""

    # -- the sending side (a Ray call from the receiving peer) ---------------------------------

    async def offer_pull(self, ask: PullRequest) -> PullOffer:
        """Pins the blocks of ``ask`` this worker caches and starts sending them; answers how
        many at once (the asker posts its receive for that many)."""
        if time.time() > ask.deadline:
            return PullOffer(ask.request_id, 0, f"{self.name} got the ask after its deadline (it was stalled)")
        if ask.pair not in self.pairs_joined:
            return PullOffer(ask.request_id, 0, f"{self.name} has no KV transfer group {ask.pair}")
        pinned = await self._call(self._pin, ask)
        if not pinned:
            return PullOffer(ask.request_id, 0, f"{self.name} caches none of the blocks asked for now")
        asyncio.get_running_loop().run_in_executor(self._receives, self._send_pinned, ask, pinned)
        return PullOffer(ask.request_id, len(pinned))

    def _pin(self, ask: PullRequest) -> list[int]:
        with self._lock:
            return self.engine.pin_prefix(ask.prompt_token_ids, ask.first_block, ask.blocks)

    def _send_pinned(self, ask: PullRequest, pinned: list[int]) -> str | None:
        """Sends the pinned blocks (every rank) until the ask's deadline, then unpins them,
        however the send ended."""
        try:
            return self.engine.send_blocks(ask.pair, ask.request_id, pinned, ask.tag_base,
                                           max(0.0, ask.deadline - time.time()))
        finally:
            with self._lock:
                self.engine.unpin(pinned)

    # -- the receiving side (in ``generate``) ------------------------------------------------

    async def _pull_prefix(self, stream, request: WorkerRequest) -> PullReport | RequestFailed | WorkerFailure:
        """Reserves the prompt's leading blocks, pulls what the peer caches of them, and admits
        the request to be prefilled here from there; returns what the pull did (with its error
        when nothing arrived), or how the request failed before it (invalid, no room)."""
        reserved = await self._reserve_blocks(stream, self._reserve_pull, request)
        if not isinstance(reserved, tuple):
            return reserved
        held, dst_blocks = reserved
        started = time.time()
        pulled, error = 0, None
        if dst_blocks:
            pulled, error = await self._receive_pull(stream, request, held, dst_blocks)
        await self._tracked(stream, self._admit_pull, request.request_id, pulled)
        arrived = error is None and pulled > 0
        self.metrics.pulled(pulled, arrived)
        self.pulls["pulled" if arrived else "recomputed"] += 1
        self.pulls["blocks"] += pulled
        return PullReport(request.kv_source, request.kv_source_blocks, held, pulled,
                          pulled * self.engine.runner.block_bytes, (started, time.time()), error)

    async def _receive_pull(self, stream, request: WorkerRequest, held: int,
                            dst_blocks: list[int]) -> tuple[int, str | None]:
        """(blocks received into ``dst_blocks``, None), or (0, why none)."""
        import ray

        source, timeout_s = request.kv_source, request.pull_timeout_s
        pair = self._peers.get(source)
        if pair is None or source not in self._pulls_from or source in self._unpaired:
            return 0, f"{self.name} has no KV transfer group with {source} now"
        group = self._groups[pair][1]  # the group this pull uses (a failure rebuilds only this one)
        from cluster.kv_transfer.sender import TAG_STRIDE  # with torch: not loaded where only the class is

        tag_base = next(self._tags[pair]) * self.engine.model_config.num_layers * TAG_STRIDE % TAG_LIMIT
        ends = time.monotonic() + timeout_s
        block_size = self.engine.config.block_size
        ask = PullRequest(request.request_id, list(request.prompt_token_ids[:request.kv_source_blocks * block_size]),
                          held, request.kv_source_blocks, pair, tag_base, time.time() + timeout_s)
        try:
            peer = self.peer_worker(source)
            offer: PullOffer = await asyncio.wait_for(peer.offer_pull.remote(ask), timeout_s)
        except asyncio.TimeoutError:
            self._pair_failed(source, group)  # it may answer and send yet: past its deadline, into a group gone
            return 0, f"{source} did not answer within {timeout_s:g}s (kv.pull_timeout_s)"
        except (ray.exceptions.RayActorError, ValueError):
            return 0, f"{source} died"
        if offer.error or not offer.blocks:
            return 0, offer.error or f"{source} offered no block"
        offered = time.monotonic()
        receiving = asyncio.get_running_loop().run_in_executor(
            self._receives, self.engine.receive_transfer, pair, request.request_id, dst_blocks[:offer.blocks],
            tag_base, max(0.001, ends - offered))
        stream.busy.append(receiving)
        error = await asyncio.shield(receiving)
        if error:
            self._pair_failed(source, group)
            return 0, f"receive from {source}: {error}"
        self.pull_cost.add((time.monotonic() - offered) / offer.blocks)  # what the router prices pulls by
        return offer.blocks, None

    # -- under the engine's lock (``_tracked``) ------------------------------------------------

    def _reserve_pull(self, request: WorkerRequest) -> tuple[int, list[int]] | None:
        reserved = self.engine.reserve_pull(request.request_id, request.prompt_token_ids, request.params,
                                            request.kv_source_blocks, request.priority,
                                            resumed_tokens=request.resumed_tokens)
        if reserved is not None:
            self.arrivals.took(request.request_id)
        return reserved

    def _admit_pull(self, request_id: str, pulled: int) -> None:
        self.engine.admit_pull(request_id, pulled)
