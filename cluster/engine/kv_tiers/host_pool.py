"""The host tier's bookkeeping, free of torch: which block hash sits in which host slot.

A device block the prefix cache evicts is stored here under its hash (``store``); a prefix that
misses the device cache but is found here is loaded back into fresh device blocks. The KV bytes
live in :class:`~cluster.engine.kv_tiers.host_store.HostKVStore`; this class only hands out
slots and records the copies (:class:`Offload`, :class:`Load`) the store must make, in order.

Eviction order: least recently stored or loaded first. A slot's entry is refreshed when its
hash is offloaded again (no copy: the bytes are already here) and when it is loaded back to
the device (the host copy stays: a block loaded and later evicted again costs no copy).
Free slots are taken lowest id first; an evicted entry's slot is reused at once. A slot that
a load in flight reads is held (``hold``/``release``): eviction passes over it, and where every
entry is held a block stored finds no room (it is not kept, as without a host tier).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Offload:
    """Copy device block ``block_id`` into host slot ``slot``."""

    block_id: int
    slot: int


@dataclass(frozen=True)
class Load:
    """Copy host slot ``slot`` into device block ``block_id``."""

    slot: int
    block_id: int


TierMove = Offload | Load


class HostBlockPool:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # head: evicted next
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest first
        self._held: Counter[int] = Counter()  # slot -> loads in flight reading it

    @property
    def num_used(self) -> int:
        return len(self._slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def entries(self) -> list[tuple[bytes, int]]:
        """(hash, slot) in eviction order, the next to go first."""
        return list(self._slots.items())

    @property
    def num_held_slots(self) -> int:
        """Slots loads in flight read."""
        return len(self._held)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._slots.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        """Moves an entry to the back of the eviction order (a load)."""
        self._slots.move_to_end(block_hash)

    def hold(self, slot: int) -> None:
        """A load reads ``slot`` until ``release``: no store reuses it meanwhile."""
        self._held[slot] += 1

    def release(self, slot: int) -> None:
        self._held[slot] -= 1
        if not self._held[slot]:
            del self._held[slot]

    def store(self, block_hash: bytes) -> tuple[int | None, bytes | None]:
        """(the slot to copy an evicted device block into, the hash dropped to make room): the
        slot is None when there is nothing to copy: the hash is here already (its entry
        refreshed), or every entry is held by a load; the hash None when a free slot was taken,
        else it is the least recently used unheld entry's, whose slot is reused."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return None, None
        dropped = None
        if self._free:
            slot = self._free.pop()
        else:
            dropped = next((h for h, s in self._slots.items() if s not in self._held), None)
            if dropped is None:
                return None, None
            slot = self._slots.pop(dropped)
        self._slots[block_hash] = slot
        return slot, dropped

    def clear(self) -> None:
        if self._held:
            raise RuntimeError("the host tier cannot be cleared while loads read it")
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
