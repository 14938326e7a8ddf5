"""Paged-KV block bookkeeping, free of torch.

The manager hands out block ids and counts references; the KV tensors live elsewhere and are
indexed by these ids. A block whose last reference is dropped goes to the tail of an LRU free
list but keeps its hash, so a later request with the same prefix can take it back (``touch``)
instead of recomputing it. Only when a fresh block is needed is the least recently freed one
reused, and its hash evicted. Every change to the set of cached hashes is recorded as an
event for the cluster's KV registry.

With a host tier (:class:`~cluster.engine.kv_tiers.host_pool.HostBlockPool`), an evicted hash is
stored there rather than lost, and a prefix that misses the device cache may continue there
(``lookup_host_prefix``, ``load_from_host``). The copies are recorded in order as moves
(``drain_moves``): the engine makes the offloads before the next forward writes a block, and
hands the loads to a background copier.

Loads run while other requests' steps do: a block being loaded (``is_loading``) is cached under
its hash at once, so a request that hits it shares the load, but it holds a reference of its
load's own and its host slot is held, until ``loads_done``: it is never reallocated, written
back, nor its slot reused meanwhile, and a request that holds it is not scheduled until it is
loaded (the scheduler's rule). A request cancelled meanwhile drops its own reference only; the
block reaches the free list when its copy is made. A load that failed uncaches its blocks.

Write-back (``write_back``) takes most of those copies off the critical path: after a step's
forward, the free cached blocks next in line for eviction are copied to the host tier ahead of
time (in the background), so that evicting them later needs no copy. The ordering rule: a
block whose write-back is not known done may not be reallocated (nor may a load or a copy of
the block manager's run) before the engine waits for the copies; ``must_wait_for_copies`` says
when, and ``copies_done`` is told when they are.
Device eviction order is unchanged by the tier: the least recently freed block first.

Events carry the tier (:mod:`cluster.engine.kv_tiers.tier`). A block evicted from the device into
the host tier is ``BlockRemoved(device)`` then ``BlockStored(host)``: the worker still holds it, one
tier down (the registry moves it, never dropping it); a hash the host tier drops to make room is
``BlockRemoved(host)``. A hash held in both tiers (loaded back: the host copy stays) is held until
both have dropped it. One allocation's events come as its device removals, then its host stores,
then its host drops, each hash's net change only (order within a hash is what counts).

Partial hits (``lookup_partial``): a cached block registered with its chain key and tokens can
also serve a prompt whose next tokens are only its first few (a prompt that ends inside a block,
or leaves a shared prefix there): the caller copies that block's KV into a fresh block and
computes only the tokens after the match. Token-granular reuse as SGLang's radix cache gives, at
the cost of one block copy; vLLM reuses full blocks only.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from itertools import islice
from dataclasses import dataclass
from typing import Sequence

from cluster.engine.kv_tiers.host_pool import HostBlockPool, Load, Offload, TierMove
from cluster.engine.kv_tiers.tier import DEVICE, HOST


PARTIAL_SCAN = 32  # cached blocks compared per partial lookup at most (the newest first)


class NoFreeBlocksError(RuntimeError):
    """Fewer free blocks than asked for; nothing was allocated."""


@dataclass(frozen=True)
class BlockStored:
    """These hashes became cached in ``tier``, in order."""

    block_hashes: tuple[bytes, ...]
    tier: str = DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    """These hashes were evicted or dropped from ``tier``."""

    block_hashes: tuple[bytes, ...]
    tier: str = DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached hash was dropped at once."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host: HostBlockPool | None = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        # Insertion order is eviction order: the head is the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._events: list[KVEvent] = []
        self._pending_kind: tuple[type[BlockStored] | type[BlockRemoved], str] | None = None
        self._pending_hashes: list[bytes] = []
        self.host = host if enable_prefix_caching else None
        self._moves: list[TierMove] = []
        self._copying: set[int] = set()  # blocks whose write-back is not known done
        self._loading: dict[int, int] = {}  # block -> the host slot its load in flight reads
        self._reused_while_copying = False
        # chain key -> first token -> {block: its tokens}, newest last (the partial-hit index)
        self._children: dict[bytes, dict[int, OrderedDict[int, tuple[int, ...]]]] = {}
        self._indexed: dict[int, tuple[bytes, int]] = {}  # block -> (chain key, first token)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[self._check_id(block_id)]

    def block_hash_of(self, block_id: int) -> bytes | None:
        """The hash this block is cached under; None if uncached or a duplicate."""
        return self._hashes[self._check_id(block_id)]

    def free_block_ids(self) -> list[int]:
        """The free list in eviction order, least recently used first."""
        return list(self._free)

    def lookup_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of block_hashes; no side effects.

        [] when caching is off.
        """
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def lookup_partial(self, chain: bytes, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """The cached block under ``chain`` whose tokens begin with most of ``token_ids`` (at
        least the first), as (block id, tokens matched); None when none does. No side effects."""
        if not token_ids or not self.enable_prefix_caching:
            return None
        candidates = self._children.get(chain, {}).get(token_ids[0])
        if not candidates:
            return None
        best: tuple[int, int] | None = None
        for block_id, held in islice(reversed(candidates.items()), PARTIAL_SCAN):
            matched = next((i for i, (a, b) in enumerate(zip(held, token_ids)) if a != b),
                           min(len(held), len(token_ids)))
            if best is None or matched > best[1]:
                best = (block_id, matched)
                if matched == len(token_ids):
                    break
        return best

    def lookup_host_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading hashes of block_hashes the host tier holds; no side effects."""
        count = 0
        if self.host is not None:
            while count < len(block_hashes) and self.host.lookup(block_hashes[count]) is not None:
                count += 1
        return count

    def load_from_host(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> int:
        """Loads the host tier's copies of leading block_hashes into block_ids (freshly allocated,
        ref 1), which become cached under those hashes; stops at the first hash the tier no
        longer holds (an allocation's offloads may have evicted it). Returns how many loaded."""
        loaded = 0
        for block_hash, block_id in zip(block_hashes, block_ids):
            slot = self.host.lookup(block_hash) if self.host is not None else None
            if slot is None or block_hash in self._cached:
                break
            self.host.touch(block_hash)
            self._moves.append(Load(slot, block_id))
            self.cache_block(block_id, block_hash)
            self.host.hold(slot)
            self._loading[block_id] = slot
            self._ref_counts[block_id] += 1  # the load's own, dropped by loads_done
            loaded += 1
        return loaded

    def is_loading(self, block_ids: Sequence[int]) -> bool:
        """Whether any of these blocks is the target of a load not known done."""
        return bool(self._loading) and any(block_id in self._loading for block_id in block_ids)

    def loads_done(self, block_ids: Sequence[int], failed: bool = False) -> None:
        """The loads into these blocks are made (``failed``: they stopped, and what the blocks
        hold is not their hashes' KV: those are uncached, as if evicted). Each block's slot is
        released and its load's reference dropped."""
        for block_id in block_ids:
            self.host.release(self._loading.pop(block_id))
            block_hash = self._hashes[block_id]
            if failed and block_hash is not None:
                self._hashes[block_id] = None
                del self._cached[block_hash]
                self._unindex(block_id)
                self._record(BlockRemoved, block_hash)
        self.free(block_ids)

    def drain_moves(self) -> list[TierMove]:
        """The copies between tiers since the last drain, in the order they must be made."""
        moves, self._moves = self._moves, []
        return moves

    def write_back(self, limit: int) -> list[Offload]:
        """Copies to the host tier, ahead of eviction, of the free cached blocks among the next
        ``limit`` to be evicted that the host does not hold yet (in eviction order). They stay
        cached on the device (and now on the host too: their events say so); the copies are the
        caller's to make, and the blocks count as being copied until ``copies_done``."""
        if self.host is None:
            return []
        offloads: list[Offload] = []
        on_host: dict[bytes, bool] = {}
        for block_id in list(islice(self._free, limit)):
            block_hash = self._hashes[block_id]
            if block_hash is None or block_id in self._copying or self.host.lookup(block_hash) is not None:
                continue
            slot = self._store_on_host(block_hash, on_host)
            if slot is None:  # every host slot is held by a load in flight
                break
            offloads.append(Offload(block_id, slot))
            self._copying.add(block_id)
        self._record_host(on_host)
        return offloads

    def must_wait_for_copies(self) -> bool:
        """Whether the write-backs must be done before the next copy or forward: a block being
        copied was reallocated (the forward or a load may write it; a load may read the slot
        it is copied to, its hash being no longer on the device), or there are offloads of the
        block manager's own to make (one may write a slot a write-back writes). Loads alone need
        not wait: they write blocks no write-back reads (referenced ones) and read slots no
        write-back writes (their hashes' blocks were not reallocated)."""
        return bool(self._copying) and (self._reused_while_copying
                                        or any(isinstance(move, Offload) for move in self._moves))

    def copies_done(self) -> None:
        """Every write-back handed out so far is made."""
        self._copying.clear()
        self._reused_while_copying = False

    def num_blocks_to_touch(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks sit in the free list now.

        Touching them takes that much free capacity, which the scheduler must budget for.
        """
        return sum(1 for block_id in set(block_ids) if block_id in self._free)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit, or a partial hit's source).

        A block at ref 0 leaves the free list but keeps its hash, so it can no longer be evicted.
        """
        for block_id in block_ids:
            if self._hashes[self._check_id(block_id)] is None and block_id not in self._indexed:
                raise ValueError(f"block {block_id} is not cached; only cached blocks are touched")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks with ref 1, taken from the LRU end of the free list.

        A taken block that held a hash is evicted from the cache (recorded as BlockRemoved).
        Raises NoFreeBlocksError, allocating nothing, if fewer than `count` blocks are free.
        """
        if count < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({count})")
        if count > len(self._free):
            raise NoFreeBlocksError(
                f"need {count} free blocks, only {len(self._free)} of {self.num_blocks} are free"
            )
        allocated: list[int] = []
        on_host: dict[bytes, bool] = {}  # hash -> stored (True) or dropped (False) by the host tier, net
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._reused_while_copying |= block_id in self._copying
            self._evict(block_id, on_host)
            self._ref_counts[block_id] = 1
            allocated.append(block_id)
        self._record_host(on_host)
        return allocated

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block.

        Blocks are walked in reverse, so a request's tail blocks reach the free list first and
        are evicted before its head blocks, which other requests are likelier to share. Freeing
        a block more times than it is referenced raises ValueError and changes nothing.
        """
        for block_id, times in Counter(block_ids).items():
            if times > self._ref_counts[self._check_id(block_id)]:
                raise ValueError(
                    f"block {block_id} freed {times}x at ref count {self._ref_counts[block_id]}"
                )
        for block_id in reversed(block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: bytes, chain: bytes | None = None,
                    token_ids: Sequence[int] = ()) -> None:
        """Mark a full, referenced block as holding block_hash; with its ``chain`` key and
        ``token_ids``, it may also serve partial hits (``lookup_partial``).

        If another block already caches this hash, the existing mapping stays and this block
        remains an uncached duplicate (it is reused like any fresh block once freed).
        No-op when caching is off.
        """
        if not self.enable_prefix_caching:
            return
        if self._ref_counts[self._check_id(block_id)] == 0:
            raise ValueError(f"block {block_id} is free; only referenced blocks can be cached")
        current = self._hashes[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return
        if block_hash in self._cached:
            return
        self._hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        self._record(BlockStored, block_hash)
        if chain is not None and token_ids:
            self._index(block_id, chain, token_ids)

    def keep_partial(self, block_id: int, chain: bytes, token_ids: Sequence[int]) -> None:
        """Indexes a block that is not full, whose first ``token_ids`` hold KV (a finished
        request's last block, about to be freed), for partial hits until it is reallocated.
        No-op for a block that is cached, shared, or when caching is off."""
        if (not self.enable_prefix_caching or not token_ids or self._hashes[self._check_id(block_id)] is not None
                or self._ref_counts[block_id] != 1):
            return
        self._index(block_id, chain, token_ids)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash if no block is referenced and record AllBlocksCleared.

        Returns False, changing nothing, while any block is referenced.
        """
        if self.num_used_blocks:
            return False
        self._cached.clear()
        self._hashes = [None] * self.num_blocks
        self._children.clear()
        self._indexed.clear()
        if self.host is not None:
            self.host.clear()
        if self.enable_prefix_caching:
            self._flush_pending()
            self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        """Events since the last drain, in order; consecutive stores or removes come as one."""
        self._flush_pending()
        events, self._events = self._events, []
        return events

    def _check_id(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return block_id

    def _evict(self, block_id: int, on_host: dict[bytes, bool]) -> None:
        block_hash = self._hashes[block_id]
        if block_hash is None:
            self._unindex(block_id)  # a request's last block, kept for partial hits only
            return
        self._hashes[block_id] = None
        del self._cached[block_hash]
        self._unindex(block_id)
        self._record(BlockRemoved, block_hash)
        if self.host is not None:
            slot = self._store_on_host(block_hash, on_host)
            if slot is not None:
                self._moves.append(Offload(block_id, slot))

    def _index(self, block_id: int, chain: bytes, token_ids: Sequence[int]) -> None:
        """Enters a block in the partial-hit index (the newest last under its first token)."""
        self._unindex(block_id)
        first = token_ids[0]
        self._children.setdefault(chain, {}).setdefault(first, OrderedDict())[block_id] = tuple(token_ids)
        self._indexed[block_id] = (chain, first)

    def _unindex(self, block_id: int) -> None:
        """Drops a block uncached from the partial-hit index."""
        where = self._indexed.pop(block_id, None)
        if where is None:
            return
        chain, first = where
        by_first = self._children[chain]
        del by_first[first][block_id]
        if not by_first[first]:
            del by_first[first]
            if not by_first:
                del self._children[chain]

    def _store_on_host(self, block_hash: bytes, on_host: dict[bytes, bool]) -> int | None:
        """The host slot to copy block_hash into (None: held already), noting in ``on_host`` the
        hash stored and any it dropped, each as its latest change."""
        slot, dropped = self.host.store(block_hash)
        for changed, stored in ((dropped, False), (block_hash if slot is not None else None, True)):
            if changed is not None:
                on_host.pop(changed, None)
                on_host[changed] = stored
        return slot

    def _record_host(self, on_host: dict[bytes, bool]) -> None:
        """The host tier's net changes of one allocation: its stores, then its drops."""
        for block_hash, stored in on_host.items():
            if stored:
                self._record(BlockStored, block_hash, HOST)
        for block_hash, stored in on_host.items():
            if not stored:
                self._record(BlockRemoved, block_hash, HOST)

    def _record(self, kind: type[BlockStored] | type[BlockRemoved], block_hash: bytes, tier: str = DEVICE) -> None:
        """Add a hash to the open batch, closing it first if it is of another kind or tier."""
        if (kind, tier) != self._pending_kind:
            self._flush_pending()
            self._pending_kind = (kind, tier)
        self._pending_hashes.append(block_hash)

    def _flush_pending(self) -> None:
        if self._pending_kind is not None:
            kind, tier = self._pending_kind
            self._events.append(kind(tuple(self._pending_hashes), tier))
        self._pending_kind = None
        self._pending_hashes = []
