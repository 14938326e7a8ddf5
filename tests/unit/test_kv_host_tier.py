"""The host KV tier's bookkeeping: which device blocks go to which host slots, in which order,
and which come back, by exact ids."""

import pytest

from cluster.engine.block_manager import BlockManager, BlockRemoved, BlockStored
from cluster.engine.kv_tiers.host_pool import HostBlockPool, Load, Offload
from cluster.engine.kv_tiers.size import HostCacheSize, parse_host_cache
from cluster.engine.kv_tiers.tier import HOST
from cluster.engine.request import Request, RequestStatus
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler

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
    # Until their copies are made, the loads hold a reference of their own.
    assert manager.is_loading([1]) and manager.is_loading([0, 2]) and not manager.is_loading([0, 3])
    assert [manager.ref_count(b) for b in range(4)] == [1, 2, 2, 0]
    manager.loads_done([1, 2])
    assert not manager.is_loading([1, 2]) and [manager.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
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
    manager.loads_done(fresh)
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
    first = copies.submit([Offload(3, 0)])
    second = copies.submit([Offload(2, 1), Offload(1, 2)])
    assert copies.submit([]) is None
    assert not copies.idle and applied == [] and not first.done.is_set()
    gate.set()
    copies.wait()
    assert copies.idle and applied == [Offload(3, 0), Offload(2, 1), Offload(1, 2)]
    assert threads == ["kv-host-copies"] * 2
    assert first.done.is_set() and second.done.is_set() and first.error is None
    assert first.submitted_at <= first.started_at <= first.finished_at <= second.started_at <= second.finished_at
    copies.close()
    assert not copies.running


def test_a_failed_copy_is_its_jobs_and_closing_drops_the_jobs_queued_behind_the_one_under_way():
    import threading

    from cluster.engine.kv_tiers.copy_queue import CopyQueue

    gates = [threading.Event() for _ in range(3)]  # one per job, by its slot
    started = [threading.Event() for _ in range(3)]

    def apply(moves):
        started[moves[0].slot].set()
        assert gates[moves[0].slot].wait(timeout=10)
        if moves[0].slot == 0:
            raise RuntimeError("copy failed")

    copies = CopyQueue(apply, name="kv-host-loads")
    failing, under_way, queued = (copies.submit([Load(slot, slot + 1)]) for slot in range(3))
    gates[0].set()
    assert failing.done.wait(10) and str(failing.error) == "copy failed"
    assert started[1].wait(10)  # the next job is under way (held)
    threading.Timer(0.1, gates[1].set).start()
    copies.close()
    assert under_way.done.is_set() and under_way.error is None  # made before the thread ended
    assert queued.done.is_set() and str(queued.error) == "the engine shut down before this copy was made"
    assert not started[2].is_set() and not copies.running


# -- loads in flight -------------------------------------------------------------------------


def test_eviction_passes_over_the_slots_loads_read_and_stores_nothing_where_all_are_read():
    pool = HostBlockPool(3)
    for block_hash in H[:3]:
        pool.store(block_hash)
    assert pool.entries() == [(H[0], 0), (H[1], 1), (H[2], 2)]
    pool.hold(0)
    pool.hold(0)  # two loads read H[0]
    assert pool.store(H[3]) == (1, H[1])  # H[0] is next to go, but read: H[1]'s slot instead
    pool.hold(2)
    pool.hold(1)
    assert pool.store(H[4]) == (None, None)  # every entry read: H[4] is not kept
    assert pool.entries() == [(H[0], 0), (H[2], 2), (H[3], 1)]
    pool.release(0)
    assert pool.store(H[4]) == (None, None)  # H[0] still read by one load
    pool.release(0)
    assert pool.store(H[4]) == (0, H[0])


def test_a_block_evicted_while_every_host_slot_is_being_loaded_from_is_dropped():
    manager = cached_manager(num_blocks=4, host_slots=1)
    assert manager.allocate(1) == [3]  # H[3] to the only slot
    manager.drain_moves()
    manager.drain_events()
    fresh = manager.allocate(1)  # evicts H[2], dropping H[3]: load H[2] back instead
    assert fresh == [2] and manager.load_from_host([H[2]], fresh) == 1
    assert manager.drain_moves() == [Offload(2, 0), Load(0, 2)]
    manager.drain_events()
    assert manager.allocate(1) == [1]  # H[1] evicted while slot 0 is read: not stored, no copy
    assert manager.drain_moves() == [] and manager.drain_events() == [BlockRemoved((H[1],))]
    assert manager.host.entries() == [(H[2], 0)]
    assert manager.write_back(4) == []  # block 0 (H[0]) would need a slot too
    manager.loads_done([2])
    assert manager.write_back(4) == [Offload(0, 0)]


def test_a_failed_load_uncaches_its_blocks_and_frees_them_when_the_request_has_gone():
    manager = cached_manager(num_blocks=4, host_slots=2)
    assert manager.allocate(2) == [3, 2]  # H[3], H[2] to slots 0, 1
    manager.free([3, 2])
    manager.drain_moves()
    manager.drain_events()
    fresh = manager.allocate(1)  # H[1] evicted into slot 0, dropping H[3]
    assert fresh == [1] and manager.load_from_host([H[2]], fresh) == 1
    assert manager.drain_moves() == [Offload(1, 0), Load(1, 1)]
    manager.drain_events()
    manager.free(fresh)  # the request went away mid-load
    assert manager.ref_count(1) == 1 and 1 not in manager.free_block_ids()
    manager.loads_done(fresh, failed=True)
    assert manager.drain_events() == [BlockRemoved((H[2],))] and manager.lookup_prefix([H[2]]) == []
    assert manager.host.entries() == [(H[1], 0), (H[2], 1)]  # the host copy stays
    assert manager.ref_count(1) == 0 and manager.free_block_ids()[-1] == 1 and manager.block_hash_of(1) is None


class HostHits:
    """A scheduler over 8 device blocks and 8 host slots (blocks of 2 tokens) where the prompt
    ``PROMPT``'s 3 cacheable blocks were computed, then evicted to host slots 2, 1, 0."""

    PROMPT = list(range(10, 17))

    def __init__(self, max_num_seqs: int = 4):
        self.manager = BlockManager(8, 2, host=HostBlockPool(8))
        self.scheduler = Scheduler(self.manager, max_num_batched_tokens=64, max_num_seqs=max_num_seqs,
                                   max_model_len=64)
        first = self.request("first", self.PROMPT, 1)
        self.step({"first": 99})
        self.hashes = first.block_hashes[:3]
        assert first.block_ids == [] and self.manager.free_block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]
        self.request("filler", list(range(30, 45)), 1)  # takes all 8 blocks: first's 3 cached ones go to the host
        self.step({"filler": 99})
        assert self.manager.drain_moves() == [Offload(2, 0), Offload(1, 1), Offload(0, 2)]

    def request(self, request_id: str, prompt: list[int], max_tokens: int) -> Request:
        made = Request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        self.scheduler.add(made)
        return made

    def step(self, tokens: dict[str, int]) -> tuple[list[str], list[tuple[str, int]]]:
        out = self.scheduler.schedule()
        self.scheduler.update(out, tokens)
        return [r.request_id for r in out.decodes], [(r.request_id, n) for r, n in out.prefills]


def test_a_host_hit_waits_in_the_queue_while_other_requests_run_and_a_second_shares_its_loads():
    """Exact ids through eviction to the host tier and loading back, in the scheduler."""
    hits = HostHits()
    manager, scheduler, request, step = hits.manager, hits.scheduler, hits.request, hits.step
    decode = request("decode", [50, 51, 52], 5)
    assert step({"decode": 60}) == ([], [("decode", 3)])
    manager.drain_moves()

    hit = request("hit", HostHits.PROMPT, 2)
    assert step({"decode": 61}) == (["decode"], [])  # the hit is not scheduled: its blocks are loading
    assert hit.status is RequestStatus.LOADING and scheduler.waiting == [hit] and scheduler.num_loading == 1
    assert hit.block_ids == [2, 3, 7, 6] and hit.num_computed_tokens == 6 and hit.num_cached_tokens == 6
    assert manager.drain_moves() == [Offload(2, 4), Offload(3, 5), Offload(7, 6), Offload(6, 7),
                                     Load(2, 2), Load(1, 3), Load(0, 7)]
    assert manager.is_loading([2, 3, 7]) and [manager.ref_count(b) for b in (2, 3, 7, 6)] == [2, 2, 2, 1]

    shared = request("shared", HostHits.PROMPT, 2)  # hits the blocks being loaded: shares them, and waits
    assert step({"decode": 62}) == (["decode"], [])
    assert shared.status is RequestStatus.LOADING and shared.block_ids == [2, 3, 7, 4]
    # Its block evicted two hashes to the full host tier, passing over the slots being read (0, 1, 2).
    assert manager.drain_moves() == [Offload(5, 3), Offload(4, 4)]  # and no load of its own
    assert [manager.ref_count(b) for b in (2, 3, 7)] == [3, 3, 3] and scheduler.num_loading == 2
    assert decode.num_output_tokens == 3

    manager.loads_done([2, 3, 7])
    # Both join the running requests with their 6 tokens computed: one prompt token left each.
    assert step({"decode": 63, "hit": 70, "shared": 70}) == (["decode"], [("hit", 1), ("shared", 1)])
    assert scheduler.num_loading == 0 and scheduler.waiting == [] and hit.token_ids[-1] == 70
    assert [manager.ref_count(b) for b in (2, 3, 7)] == [2, 2, 2]


def test_a_request_cancelled_while_loading_frees_its_seat_at_once_and_its_blocks_after_the_copy():
    hits = HostHits(max_num_seqs=1)
    manager, scheduler = hits.manager, hits.scheduler
    hit = hits.request("hit", HostHits.PROMPT, 2)
    assert hits.step({}) == ([], []) and hit.status is RequestStatus.LOADING and hit.block_ids == [0, 1, 2, 3]
    # Block 1 is evicted (its hash copied out) and then loaded into: the engine makes offloads first.
    assert manager.drain_moves() == [Offload(1, 3), Offload(2, 4), Offload(3, 5), Load(2, 0), Load(1, 1), Load(0, 2)]
    later = hits.request("later", [50, 51, 52], 1)
    assert hits.step({}) == ([], [])  # its seat is the loading request's
    scheduler.abort("hit")
    assert scheduler.num_loading == 0 and [manager.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert manager.free_block_ids() == [7, 6, 5, 4, 3]  # the loads' targets are not reallocated meanwhile
    assert hits.step({"later": 99}) == ([], [("later", 3)]) and later.finished
    manager.loads_done([0, 1, 2])
    assert manager.num_used_blocks == 0 and manager.lookup_prefix(hit.block_hashes[:3]) == [0, 1, 2]
    assert manager.free_block_ids()[-3:] == [2, 1, 0]


@pytest.mark.parametrize("cache_dtype", ["auto", "int8"])
def test_the_host_store_loads_layer_by_layer_what_it_offloaded(cache_dtype):
    import torch

    from cluster.engine.kv_tiers.host_store import HostKVStore, host_format
    from cluster.engine.quantization.kv_format import KVCacheFormat

    device_format = KVCacheFormat(cache_dtype, torch.float32)
    fmt = host_format(device_format, "cpu")  # 8-bit rows on the host either way
    values = torch.randn(3, 2, 6, 2, 2, 4, generator=torch.Generator().manual_seed(0))  # [layers, 2, blocks, ...]
    cache = device_format.quantize_rows(values).contiguous()
    store = HostKVStore(cache, device_format, fmt, num_slots=2, head_dim=4)
    issued = []
    store.layer_issued = issued.append
    original = cache.clone()
    store.offload([Offload(1, 0), Offload(4, 1)])
    store.load([Load(1, 2), Load(0, 5)])
    assert issued == [0, 1, 2]
    round_trip = device_format.quantize_rows(fmt.dequantize_rows(fmt.quantize_rows(
        device_format.dequantize_rows(original))))
    assert torch.equal(cache[:, :, 2], round_trip[:, :, 4]) and torch.equal(cache[:, :, 5], round_trip[:, :, 1])
    untouched = [0, 1, 3, 4]
    assert torch.equal(cache[:, :, untouched], original[:, :, untouched])
    if cache_dtype == "int8":  # the same 8-bit rows on both tiers: the bytes come back unchanged
        assert not store.converts and torch.equal(cache[:, :, 2], original[:, :, 4])
    else:  # within half a code step of each row
        step = values[:, :, 4].abs().amax(-1, keepdim=True) / 254
        assert (cache[:, :, 2] - values[:, :, 4]).abs().le(step * 1.0001).all()


def test_a_transferred_request_whose_host_blocks_are_loading_decodes_once_they_are_in():
    hits = HostHits()
    manager, scheduler = hits.manager, hits.scheduler
    request = Request("moved", HostHits.PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert scheduler.reserve_for_transfer(request) == 3  # its 3 host blocks do not travel: loaded here
    assert request.block_ids == [0, 1, 2, 3] and manager.is_loading([0, 1, 2]) and not manager.is_loading([3])
    scheduler.admit_transferred("moved", 70)  # the last block's KV and the first token came
    assert request.status is RequestStatus.LOADING and scheduler.waiting == [request]
    assert scheduler.schedule().is_empty
    manager.loads_done([0, 1, 2])
    out = scheduler.schedule()
    assert out.decodes == [request] and request.status is RequestStatus.RUNNING and scheduler.num_loading == 0


def test_a_peer_pull_pins_and_loads_only_the_host_blocks_past_what_the_peer_holds():
    hits = HostHits()
    manager = hits.manager
    pinned = hits.scheduler.pin_prefix(hits.hashes, first_block=2)
    # The peer holds blocks 0 and 1: only the third (host slot 0) is loaded, into a fresh block.
    assert pinned == [0] and manager.drain_moves() == [Load(0, 0)]  # block 0 held no hash
    assert manager.is_loading([0]) and [manager.ref_count(b) for b in range(8)] == [2, 0, 0, 0, 0, 0, 0, 0]
    manager.loads_done(pinned)
    manager.free(pinned)  # sent
    assert manager.num_used_blocks == 0 and manager.lookup_prefix(hits.hashes[2:]) == [0]
