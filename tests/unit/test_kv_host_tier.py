"""The host KV tier's bookkeeping: which device blocks go to which host slots, in which order,
and which come back, by exact ids."""

import pytest

from cluster.engine.block_manager import BlockManager, BlockRemoved, BlockStored
from cluster.engine.kv_tiers.host_pool import HostBlockPool, Load, Offload
from cluster.engine.kv_tiers.size import HostCacheSize, parse_host_cache
from cluster.engine.kv_tiers.tier import HOST

H = [bytes([i]) * 4 for i in range(8)]


def cached_manager(num_blocks: int = 4, host_slots: int = 2) -> BlockManager:
    """Blocks 0..n-1 cached as H[0..n-1] and freed: the free list is n-1, ..., 1, 0 (tail first)."""
    manager = BlockManager(num_blocks, block_size=2, host=HostBlockPool(host_slots))
    blocks = manager.allocate(num_blocks)
    for block_id in blocks:
        manager.cache_block(block_id, H[block_id])
    manager.free(blocks)
    manager.drain_events()
    return manager


def test_evicted_blocks_go_to_host_slots_in_lru_order():
    manager = cached_manager()
    assert manager.free_block_ids() == [3, 2, 1, 0]
    assert [manager.allocate(1) for _ in range(3)] == [[3], [2], [1]]
    # Slots 0 and 1 fill first; the third eviction takes the least recently stored entry's slot (H[3]'s, 0).
    assert manager.drain_moves() == [Offload(3, 0), Offload(2, 1), Offload(1, 0)]
    assert manager.host.entries() == [(H[2], 1), (H[1], 0)]
    assert manager.lookup_prefix(H[:3]) == [0]
    assert manager.lookup_host_prefix(H[1:3]) == 2
    assert manager.lookup_host_prefix([H[3]]) == 0


def test_host_hits_load_into_fresh_blocks_that_become_cached():
    manager = cached_manager()
    taken = [manager.allocate(1)[0] for _ in range(3)]
    manager.free(taken)
    manager.drain_moves()
    manager.drain_events()
    assert manager.free_block_ids() == [0, 1, 2, 3]
    manager.touch(manager.lookup_prefix(H[:3]))  # H[0] still on the device, in block 0
    fresh = manager.allocate(2)
    assert fresh == [1, 2]
    assert manager.load_from_host(H[1:3], fresh) == 2
    assert manager.drain_moves() == [Load(0, 1), Load(1, 2)]
    assert manager.lookup_prefix(H[:3]) == [0, 1, 2]
    assert manager.drain_events() == [BlockStored((H[1], H[2]))]
    # Loads refresh the host entries; the copies stay, so evicting these blocks again copies nothing.
    assert manager.host.entries() == [(H[1], 0), (H[2], 1)]
    manager.free([0, 1, 2])
    assert manager.free_block_ids() == [3, 2, 1, 0]
    assert manager.allocate(3) == [3, 2, 1]
    # Blocks 2 and 1 held H[2] and H[1], both still on the host: no copy, their entries refreshed.
    assert manager.drain_moves() == []
    assert manager.host.entries() == [(H[2], 1), (H[1], 0)]


def test_a_load_stops_where_the_allocation_evicted_the_host_copy():
    manager = cached_manager(num_blocks=3, host_slots=1)
    assert manager.allocate(1) == [2]
    manager.free([2])
    manager.drain_moves()
    assert manager.host.entries() == [(H[2], 0)]
    assert manager.lookup_host_prefix([H[2]]) == 1
    fresh = manager.allocate(1)  # evicts H[1] (block 1) into the only slot, dropping H[2]
    assert fresh == [1]
    assert manager.load_from_host([H[2]], fresh) == 0
    assert manager.drain_moves() == [Offload(1, 0)]
    assert manager.lookup_prefix([H[2]]) == []


def test_reset_clears_both_tiers():
    manager = cached_manager()
    manager.free(manager.allocate(2))
    assert manager.host.num_used == 2
    assert manager.reset_prefix_cache()
    assert manager.host.num_used == 0 and manager.host.num_free == 2
    assert manager.lookup_host_prefix(H) == 0


def test_no_host_tier_without_prefix_caching():
    manager = BlockManager(2, 2, enable_prefix_caching=False, host=HostBlockPool(2))
    assert manager.host is None
    assert manager.lookup_host_prefix(H) == 0


@pytest.mark.parametrize("value, size", [(None, None), (8, HostCacheSize(blocks=8)),
                                         ("512MiB", HostCacheSize(bytes=512 * 2**20)),
                                         ("1.5GiB", HostCacheSize(bytes=3 * 2**29))])
def test_host_cache_sizes(value, size):
    assert parse_host_cache(value) == size


@pytest.mark.parametrize("value", [0, -1, True, "512", "512MB", "0MiB", 1.5])
def test_bad_host_cache_sizes_say_what_to_write(value):
    with pytest.raises(ValueError, match="must be null, a positive number of blocks or a size such as '512MiB'"):
        parse_host_cache(value)


def test_events_move_an_offloaded_block_to_the_host_tier_and_drop_what_the_host_evicts():
    manager = cached_manager()
    assert manager.allocate(2) == [3, 2]
    # Both fit in free host slots: removed from the device, stored on the host, one allocation's events.
    assert manager.drain_events() == [BlockRemoved((H[3], H[2])), BlockStored((H[3], H[2]), HOST)]
    assert manager.allocate(1) == [1]
    # The host is full: H[1] takes the slot of H[3], the least recently stored, which the worker no longer holds.
    assert manager.drain_events() == [BlockRemoved((H[1],)), BlockStored((H[1],), HOST), BlockRemoved((H[3],), HOST)]


def test_a_hash_stored_and_dropped_in_one_allocation_comes_out_dropped():
    manager = cached_manager(num_blocks=3, host_slots=1)
    assert manager.allocate(2) == [2, 1]
    # H[2] went to the only slot, then H[1] took it: the host holds H[1] alone.
    assert manager.drain_moves() == [Offload(2, 0), Offload(1, 0)]
    assert manager.host.entries() == [(H[1], 0)]
    assert manager.drain_events() == [BlockRemoved((H[2], H[1])), BlockStored((H[1],), HOST),
                                      BlockRemoved((H[2],), HOST)]


def test_a_loaded_block_is_in_both_tiers_until_the_host_drops_it():
    manager = cached_manager()
    manager.free(manager.allocate(1))  # H[3] to host slot 0; block 3 free again, uncached, at the tail
    manager.drain_moves()
    assert manager.free_block_ids() == [2, 1, 0, 3]
    manager.drain_events()
    fresh = manager.allocate(1)  # evicts H[2] to slot 1
    assert fresh == [2]
    assert manager.load_from_host([H[3]], fresh) == 1  # H[3] back on the device, in block 2; the host copy stays
    manager.free(fresh)
    assert manager.drain_events() == [BlockRemoved((H[2],)), BlockStored((H[2],), HOST), BlockStored((H[3],))]
    assert manager.allocate(3) == [1, 0, 3]  # H[1] and H[0] to the host, in the slots of H[2] and H[3] (loaded: later)
    assert manager.drain_events() == [BlockRemoved((H[1], H[0])), BlockStored((H[1], H[0]), HOST),
                                      BlockRemoved((H[2], H[3]), HOST)]
    # H[3] is now on the device only (block 2); evicting it stores it again, dropping H[1].
    assert manager.allocate(1) == [2]
    assert manager.drain_events() == [BlockRemoved((H[3],)), BlockStored((H[3],), HOST), BlockRemoved((H[1],), HOST)]


def test_write_back_copies_the_next_blocks_to_be_evicted_ahead_and_evicting_them_copies_nothing():
    manager = cached_manager(num_blocks=4, host_slots=3)
    assert manager.free_block_ids() == [3, 2, 1, 0]
    # The next two in line, not yet on the host: copied ahead, still cached on the device.
    assert manager.write_back(2) == [Offload(3, 0), Offload(2, 1)]
    assert manager.drain_events() == [BlockStored((H[3], H[2]), HOST)]
    assert manager.lookup_prefix(H[:4]) == [0, 1, 2, 3]
    assert manager.write_back(3) == [Offload(1, 2)]  # 3 and 2 are on the host already
    manager.copies_done()
    assert manager.allocate(2) == [3, 2]
    assert manager.drain_moves() == []  # their copies were made ahead: evicting them costs nothing
    assert manager.drain_events() == [BlockStored((H[1],), HOST), BlockRemoved((H[3], H[2]))]  # the host keeps them


def test_a_block_being_written_back_is_not_reused_before_the_copies_are_waited_for():
    manager = cached_manager(num_blocks=4, host_slots=4)
    assert manager.write_back(1) == [Offload(3, 0)]
    assert not manager.must_wait_for_copies()  # nothing touches block 3 or slot 0 yet
    manager.touch([manager.lookup_prefix([H[0]])[0]])  # a prefix hit only reads
    assert not manager.must_wait_for_copies()
    assert manager.allocate(1) == [3]  # block 3 reallocated: the next forward writes it
    assert manager.must_wait_for_copies()
    manager.copies_done()
    assert not manager.must_wait_for_copies()
    assert manager.free_block_ids() == [2, 1]
    assert manager.write_back(1) == [Offload(2, 1)]
    manager.copies_done()
    manager.free(manager.allocate(1))  # block 2, whose copy is done: reused at once, no copy to wait for
    assert not manager.must_wait_for_copies() and manager.drain_moves() == []


def test_the_block_managers_own_copies_wait_for_the_write_backs_in_flight():
    manager = cached_manager(num_blocks=4, host_slots=4)
    assert manager.write_back(1) == [Offload(3, 0)]
    manager.touch([3])  # a prefix hit on the block being copied: read only
    assert manager.allocate(1) == [2]  # H[2] evicted: a copy of the manager's own, to slot 1
    assert manager.must_wait_for_copies()
    assert manager.drain_moves() == [Offload(2, 1)]


def test_the_copy_queue_applies_in_order_off_the_callers_thread_and_wait_blocks_until_done():
    import threading

    from cluster.engine.kv_tiers.copy_queue import CopyQueue

    gate, applied, threads = threading.Event(), [], []

    def apply(moves):
        gate.wait(timeout=10)
        threads.append(threading.current_thread().name)
        applied.extend(moves)

    copies = CopyQueue(apply)
    copies.submit([Offload(3, 0)])
    copies.submit([Offload(2, 1), Offload(1, 2)])
    assert not copies.idle and applied == []
    gate.set()
    copies.wait()
    assert copies.idle and applied == [Offload(3, 0), Offload(2, 1), Offload(1, 2)]
    assert threads == ["kv-host-copies"] * 2
    copies.close()
