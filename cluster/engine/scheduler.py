"""Continuous batching by token counts.

Each step gives every scheduled request a number of tokens under a token budget: one for a
request that is decoding, a chunk of what is left for one whose prompt (or, after preemption,
prompt and output) still lacks KV. Running requests go first in priority order; waiting ones
are admitted while budget and blocks last. When a running request needs a block and none is
free, the lowest-priority running request is preempted: its blocks are freed (their contents
stay cached) and it is recomputed later. Knows nothing of torch.

A request whose prefix is being loaded from the host KV tier (its own loads, or another
request's it shares: ``BlockManager.is_loading``) holds its blocks and a seat but stays in the
waiting queue, passed over (``RequestStatus.LOADING``), while the others' steps run; once its
blocks are in it joins the running requests with that prefix computed, before the step's
scheduling, as one whose prompt is part done.

Past its full-block hits, an admitted prompt's next tokens may be a partial hit
(``BlockManager.lookup_partial``): the step copies that cached block's KV into the request's own
next block before its forward (``SchedulerOutput.block_copies``, the source held until
``update``) and computes only what follows. A repeated prompt then computes one token, as
llama.cpp's server does; with whole blocks only, up to a block's worth (a 20-token prompt's
first step took 6.2 ms here against 5.3 for one token: 2-core EPYC, the default model).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from cluster.engine.block_hash import ExtraKey, cacheable_prefix_blocks, chain_key, hash_token_blocks, request_hash_keys
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import FinishReason, Request, RequestStatus
from cluster.engine.request_limits import InvalidRequestError, quote


@dataclass
class SchedulerOutput:
    """One step's work: decodes (one token each) first, then prompt chunks, then verifies:
    decodes with guesses (``Request.spec_token_ids``), their last token and each guess a row."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    verifies: list[tuple[Request, int]] = field(default_factory=list)  # (request, 1 + guesses)
    # (cached block, fresh block): partial hits whose KV the step copies before its forward; each
    # source is held until ``Scheduler.update``
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills) + sum(n for _, n in self.verifies)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.verifies

    def scheduled(self) -> Iterable[tuple[Request, int]]:
        yield from ((r, 1) for r in self.decodes)
        yield from self.prefills
        yield from self.verifies


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        extra_hash_keys: Sequence[ExtraKey] = (),
        partial_hits: bool = True,
    ):
        self.blocks = block_manager
        self.block_size = block_manager.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.extra_hash_keys = tuple(extra_hash_keys)
        # A prompt's tokens in the block after its full hits may come from a cached block that
        # begins with them (copied: ``SchedulerOutput.block_copies``). Off where another cache
        # (a draft model's) would have to be copied alike.
        self.partial_hits = partial_hits
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.receiving: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.num_loading = 0  # waiting requests whose prefix is being loaded (each holds a seat)

    # -- admission ------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Refuses a request that could never run, with a message saying what to change."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {quote(request.request_id)} is already in use")
        n = request.num_prompt_tokens
        if n == 0:
            raise InvalidRequestError("prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens but the model's context is {self.max_model_len} tokens "
                f"(the prompt must leave room for at least one generated token)"
            )
        longest = min(n + request.params.max_tokens, self.max_model_len)
        needed = _cdiv(longest, self.block_size)
        if needed > self.blocks.num_blocks:
            raise InvalidRequestError(
                f"prompt ({n} tokens) plus max_tokens ({request.params.max_tokens}) needs {needed} KV blocks "
                f"but the cache has {self.blocks.num_blocks}; lower max_tokens or give the engine more KV blocks"
            )

    def add(self, request: Request) -> None:
        self.check(request)
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=lambda r: r.order)

    # -- decode side of disaggregation --------------------------------------------------

    def reserve_for_transfer(self, request: Request) -> int | None:
        """Holds blocks for a prompt whose KV a prefill worker will send: the prompt's full
        blocks already cached here are reused, the rest allocated. Returns how many leading
        blocks are cached (those do not travel), or None when there is no room now; with a host
        tier, those it holds after the device's are loaded back and do not travel either.
        The request waits, outside the batch, until :meth:`admit_transferred`."""
        return self._hold(request, request.num_tokens // self.block_size, _cdiv(request.num_tokens, self.block_size))

    def reserve_for_pull(self, request: Request, blocks: int) -> int | None:
        """Holds the prompt's first ``blocks`` blocks (at most its cacheable ones) for KV a peer
        worker will send from its cache: as :meth:`reserve_for_transfer`, the leading ones cached
        here (either tier) are reused and do not travel. The rest of the prompt is computed here
        after :meth:`admit_pulled`; until then the request waits outside the batch."""
        limit = min(blocks, cacheable_prefix_blocks(request.num_tokens, self.block_size))
        return self._hold(request, limit, limit)

    def _hold(self, request: Request, limit: int, num_blocks: int) -> int | None:
        """Reserves ``num_blocks`` leading blocks, reusing the cached ones among the first
        ``limit``; the request goes to ``receiving``. The cached count, or None (no room)."""
        self.check(request)
        hits = self._cached_prefix(request, limit)
        on_host = self._host_prefix(request, len(hits), limit)
        new_blocks = num_blocks - len(hits)
        if new_blocks + self.blocks.num_blocks_to_touch(hits) > self.blocks.num_free_blocks:
            return None
        self.blocks.touch(hits)
        fresh = self.blocks.allocate(new_blocks)
        if on_host:
            loaded = self.blocks.load_from_host(request.block_hashes[len(hits):len(hits) + on_host], fresh)
            hits, fresh = hits + fresh[:loaded], fresh[loaded:]
        request.block_ids = hits + fresh
        request.num_registered_blocks = len(hits)
        request.num_cached_tokens = len(hits) * self.block_size
        request.status = RequestStatus.RECEIVING
        self.requests[request.request_id] = request
        self.receiving[request.request_id] = request
        return len(hits)

    def admit_pulled(self, request_id: str, pulled_blocks: int) -> Request:
        """A pull reserved by :meth:`reserve_for_pull` ended with ``pulled_blocks`` blocks
        received after those cached here (0: it failed, and they are computed here like the
        rest). The request joins the batch with that prefix computed (once the blocks it holds
        from the host tier are loaded); its remaining prompt tokens are prefilled by the next
        steps, into the blocks it holds and more."""
        request = self.receiving.pop(request_id)
        cached = request.num_registered_blocks + max(0, min(pulled_blocks, len(request.block_ids)
                                                            - request.num_registered_blocks))
        request.num_computed_tokens = cached * self.block_size
        request.num_cached_tokens = request.num_computed_tokens
        self._register_full_blocks(request)
        self._run_when_loaded(request)
        return request

    def _run_when_loaded(self, request: Request) -> None:
        """A request past its reserve joins the running ones, or, while blocks of its prefix are
        being loaded, waits for them in the queue."""
        if self.blocks.is_loading(request.block_ids):
            request.status = RequestStatus.LOADING
            self.num_loading += 1
            bisect.insort(self.waiting, request, key=lambda r: r.order)
        else:
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _start_loaded(self) -> None:
        """The waiting requests whose prefix is loaded now join the running ones."""
        if not self.num_loading:
            return
        for request in [r for r in self.waiting if r.status is RequestStatus.LOADING
                        and not self.blocks.is_loading(r.block_ids)]:
            self.waiting.remove(request)
            self.num_loading -= 1
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def pin_prefix(self, block_hashes: Sequence[bytes], first_block: int) -> list[int]:
        """For a peer that pulls this prefix: references the leading blocks of ``block_hashes``
        cached here from ``first_block`` on (device blocks touched, host-tier blocks loaded into
        fresh ones, as far as there is room), so no eviction takes them while they are sent.
        Returns their ids (the caller frees them when sent); [] when none past ``first_block``.
        Host-tier blocks before ``first_block`` are not loaded: the peer holds them."""
        device = self.blocks.lookup_prefix(block_hashes)
        on_host = self.blocks.lookup_host_prefix(block_hashes[len(device):])
        if len(device) + on_host <= first_block:
            return []
        touched = device[first_block:]
        start = max(len(device), first_block)  # the first host-tier block to send
        wanted = min(len(device) + on_host - start,
                     max(0, self.blocks.num_free_blocks - self.blocks.num_blocks_to_touch(touched)))
        self.blocks.touch(touched)
        loaded: list[int] = []
        if wanted:
            fresh = self.blocks.allocate(wanted)
            count = self.blocks.load_from_host(block_hashes[start:start + wanted], fresh)
            loaded = fresh[:count]
            self.blocks.free(fresh[count:])
        return touched + loaded

    def admit_transferred(self, request_id: str, first_token: int) -> Request:
        """The prompt's KV has arrived and the prefill worker sampled ``first_token``: the
        request joins the batch as a decode (or finishes, if that token ends it), once the
        blocks it holds from the host tier are loaded."""
        request = self.receiving[request_id]
        request.num_computed_tokens = request.num_tokens
        self._register_full_blocks(request)
        request.token_ids.append(first_token)
        reason = self._stop_reason(request, first_token)
        if reason is not None:
            self.finish(request, reason)
        else:
            del self.receiving[request_id]
            self._run_when_loaded(request)
        return request

    def _hash_blocks(self, request: Request, token_ids: Sequence[int], start_block: int = 0) -> list[bytes]:
        keys = request_hash_keys(self.extra_hash_keys, request.cache_salt)
        parent = request.block_hashes[start_block - 1] if start_block else None
        return hash_token_blocks(token_ids, self.block_size, keys, parent=parent, start_block=start_block)

    # -- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._start_loaded()
        self.running.sort(key=lambda r: r.order)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(request.num_tokens - request.num_computed_tokens + len(request.spec_token_ids), budget)
            del request.spec_token_ids[max(0, count - 1):]  # the guesses the budget leaves room for
            if request.spec_token_ids and not self._reserve(request, request.num_computed_tokens + count):
                request.spec_token_ids.clear()  # guesses never take another request's blocks
                count = 1
            if not self._reserve_until_fits(request, request.num_computed_tokens + count, out):
                break
            self._emit(out, request, count)
            budget -= count
            index += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _reserve_until_fits(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Makes room for ``request``'s blocks by preempting from the back of the running list;
        False when the request itself had to be preempted."""
        while not self._reserve(request, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _reserve(self, request: Request, num_tokens: int) -> bool:
        needed = _cdiv(num_tokens, self.block_size) - len(request.block_ids)
        if needed <= 0:
            return True
        if needed > self.blocks.num_free_blocks:
            return False
        request.block_ids.extend(self.blocks.allocate(needed))
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admits waiting requests in order while budget, seats and blocks last; one whose
        prefix is to be loaded (or is being loaded for another) takes its blocks and seat and
        waits, and those behind it go on."""
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) + self.num_loading < self.max_num_seqs:
            request = self.waiting[index]
            if request.status is RequestStatus.LOADING:
                index += 1
                continue
            hits = self._prefix_hits(request)
            on_host = self._host_prefix(request, len(hits),
                                        cacheable_prefix_blocks(request.num_tokens, self.block_size))
            start = (len(hits) + on_host) * self.block_size
            partial = None if on_host or self.blocks.is_loading(hits) else self._partial_hit(request, len(hits))
            if partial is not None:
                start += partial[1]
            remaining = request.num_tokens - start
            count = min(remaining, budget)
            if count < remaining and not self.enable_chunked_prefill:
                if budget < self.max_num_batched_tokens:
                    return
                count = remaining
            new_blocks = _cdiv(start + count, self.block_size) - len(hits)  # the host hits' blocks too
            held = hits + [partial[0]] if partial is not None else hits  # a copy's source: until the step's update
            if new_blocks + self.blocks.num_blocks_to_touch(held) > self.blocks.num_free_blocks:
                return
            self.blocks.touch(held)
            fresh = self.blocks.allocate(new_blocks)
            if partial is not None:
                out.block_copies.append((partial[0], fresh[0]))
            if on_host:
                loaded = self.blocks.load_from_host(request.block_hashes[len(hits):len(hits) + on_host], fresh)
                if loaded < on_host:  # the allocation's own offloads evicted the rest: computed instead
                    start = (len(hits) + loaded) * self.block_size
                    remaining = request.num_tokens - start
                    count = min(remaining, budget) if self.enable_chunked_prefill else remaining
                hits = hits + fresh[:loaded]
                fresh = fresh[loaded:]
            request.block_ids = hits + fresh
            request.num_computed_tokens = start
            request.num_registered_blocks = len(hits)
            if request.num_preemptions == 0:
                request.num_cached_tokens = start
            if self.blocks.is_loading(hits):
                request.status = RequestStatus.LOADING
                self.num_loading += 1
                index += 1
                continue
            request.status = RequestStatus.RUNNING
            self.waiting.pop(index)
            self.running.append(request)
            self._emit(out, request, count)
            budget -= count

    def cached_prefix_blocks(self, request: Request) -> int:
        """How many of the request's leading blocks would be prefix-cache hits now."""
        return len(self._prefix_hits(request))

    def _prefix_hits(self, request: Request) -> list[int]:
        """Cached blocks of the longest known prefix, leaving at least the last token to compute."""
        return self._cached_prefix(request, cacheable_prefix_blocks(request.num_tokens, self.block_size))

    def _partial_hit(self, request: Request, block: int) -> tuple[int, int] | None:
        """A cached block that begins with the request's tokens in its block ``block`` (the one
        after its full hits), as (block id, tokens matched); the last token is left to compute."""
        if not self.partial_hits or not self.blocks.enable_prefix_caching:
            return None
        begin = block * self.block_size
        tokens = request.token_ids[begin:min(begin + self.block_size, request.num_tokens - 1)]
        if not tokens:
            return None
        return self.blocks.lookup_partial(self._chain(request, block), tokens)

    def _chain(self, request: Request, block: int) -> bytes:
        """The chain key of the request's block ``block`` (``block_hash.chain_key``)."""
        self._extend_hashes(request, block)
        parent = request.block_hashes[block - 1] if block else None
        return chain_key(parent, request_hash_keys(self.extra_hash_keys, request.cache_salt))

    def _host_prefix(self, request: Request, device_hits: int, limit: int) -> int:
        """How many blocks after the device cache's ``device_hits`` the host tier holds, among
        the request's first ``limit``."""
        if self.blocks.host is None:
            return 0
        return self.blocks.lookup_host_prefix(request.block_hashes[device_hits:limit])

    def _cached_prefix(self, request: Request, max_blocks: int) -> list[int]:
        """Cached blocks of the longest known prefix among the request's first ``max_blocks``."""
        if not self.blocks.enable_prefix_caching:
            return []
        self._extend_hashes(request, max_blocks)
        return self.blocks.lookup_prefix(request.block_hashes[:max_blocks])

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        """Hashes the request's blocks up to ``num_blocks``, continuing the chain it has."""
        have = len(request.block_hashes)
        if have < num_blocks:
            tokens = request.token_ids[: num_blocks * self.block_size]
            request.block_hashes += self._hash_blocks(request, tokens, have)

    def _emit(self, out: SchedulerOutput, request: Request, count: int) -> None:
        # A decode feeds back a sampled token; the last token of a prompt (a one-token prompt,
        # a prompt one token past a cached prefix, a chunk's tail) is still a prompt chunk.
        decoding = request.num_computed_tokens == request.num_tokens - 1 and request.num_output_tokens
        if decoding and request.spec_token_ids:
            out.verifies.append((request, count))
        elif count == 1 and decoding:
            out.decodes.append(request)
        else:
            out.prefills.append((request, count))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.spec_token_ids.clear()
        self.blocks.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.order)

    # -- after the model ran --------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]],
               stopped: frozenset[str] = frozenset()) -> list[Request]:
        """Advances computed counts, caches blocks that became full, appends sampled tokens and
        finishes requests that hit a stop: a token-level one, or a stop string completed by this
        step's last token (``stopped``, found by the detokenizer). A verify's tokens are the ones
        its step emits (``speculative.verify``): the KV of its last token and of the guesses kept
        is computed, and the blocks held for the others go back (as do look-ahead blocks held for
        guesses the budget left out). Returns the requests that finished."""
        if out.block_copies:  # the step made its copies: their sources go back
            self.blocks.free([source for source, _ in out.block_copies])
        finished = []
        verifying = {id(r) for r, _ in out.verifies}
        for request, count in out.scheduled():
            tokens = sampled.get(request.request_id)
            tokens = [] if tokens is None else [tokens] if isinstance(tokens, int) else list(tokens)
            guessed = id(request) in verifying
            request.num_computed_tokens += len(tokens) if guessed else count
            request.spec_token_ids.clear()
            reason = None
            for index, token in enumerate(tokens):
                request.token_ids.append(token)
                last = index == len(tokens) - 1
                reason = (FinishReason.STOP if last and request.request_id in stopped
                          else self._stop_reason(request, token))
                if reason is not None:
                    break
            self._register_full_blocks(request)  # a verify's kept guesses may have filled blocks too
            if reason is not None:
                self.finish(request, reason)
                finished.append(request)
            else:  # held for guesses not kept, or for guesses the step's budget left out
                self._release_unused_blocks(request)
        return finished

    def reserve_lookahead(self, request: Request, num_tokens: int, spare_blocks: int = 0) -> int:
        """Holds blocks for the request's first ``num_tokens`` tokens' slots (its tokens and the
        guesses after them) from free blocks only, leaving ``spare_blocks`` free, never preempting;
        returns how many tokens its blocks now cover (at most ``num_tokens``)."""
        needed = _cdiv(num_tokens, self.block_size) - len(request.block_ids)
        grant = min(needed, self.blocks.num_free_blocks - spare_blocks)
        if grant > 0:
            request.block_ids.extend(self.blocks.allocate(grant))
        return min(num_tokens, len(request.block_ids) * self.block_size)

    def _release_unused_blocks(self, request: Request) -> None:
        """Frees the blocks past those the request's tokens need (held for guesses not kept)."""
        needed = _cdiv(request.num_tokens, self.block_size)
        if len(request.block_ids) > needed:
            self.blocks.free(request.block_ids[needed:])
            del request.block_ids[needed:]

    def _register_full_blocks(self, request: Request) -> None:
        if not self.blocks.enable_prefix_caching:
            return
        full = min(request.num_computed_tokens, request.num_tokens) // self.block_size  # tokens past a stop: no KV
        if full <= request.num_registered_blocks:
            return
        self._extend_hashes(request, full)
        bs = self.block_size
        for i in range(request.num_registered_blocks, full):
            self.blocks.cache_block(request.block_ids[i], request.block_hashes[i], self._chain(request, i),
                                    request.token_ids[i * bs:(i + 1) * bs])
        request.num_registered_blocks = full

    def tokens_before_stop(self, request: Request, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, appended in order, the request takes: up to and including the
        first that ends it (an end-of-sequence or stop token, ``max_tokens``, the context)."""
        for index, token in enumerate(tokens):
            if self._stop_reason(request, token, ahead=index + 1) is not None:
                return index + 1
        return len(tokens)

    def _stop_reason(self, request: Request, token: int, ahead: int = 0) -> FinishReason | None:
        """Why ``token`` ends the request, or None; ``ahead``: tokens the request is still to take
        up to and including this one (0: it has been appended)."""
        params = request.params
        if (token in request.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if (request.num_output_tokens + ahead >= params.max_tokens
                or request.num_tokens + ahead >= self.max_model_len):
            return FinishReason.LENGTH
        return None

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """Ends a request wherever it is and returns its blocks at once."""
        if request.finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.RECEIVING:
            del self.receiving[request.request_id]
        elif request in self.waiting:
            self.waiting.remove(request)
            if request.status is RequestStatus.LOADING:
                self.num_loading -= 1
        if request.block_ids:
            if request.status is RequestStatus.RUNNING and request.load_failure is None:
                self._keep_last_block(request)
            self.blocks.free(request.block_ids)
            request.block_ids = []
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        self.requests.pop(request.request_id, None)

    def _keep_last_block(self, request: Request) -> None:
        """Offers a finished request's last block, when not full, to later prompts that begin with
        its tokens (a chat's next turn): the tokens whose KV it holds, for partial hits."""
        if not self.partial_hits or not self.blocks.enable_prefix_caching:
            return
        computed = min(request.num_computed_tokens, request.num_tokens)
        full, held = divmod(computed, self.block_size)
        if not held or full >= len(request.block_ids):
            return
        self.blocks.keep_partial(request.block_ids[full], self._chain(request, full),
                                 request.token_ids[full * self.block_size:computed])

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, FinishReason.ABORT)
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.receiving)

