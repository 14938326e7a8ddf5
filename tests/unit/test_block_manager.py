import pytest

from cluster.engine.block_manager import (
    AllBlocksCleared,
    BlockManager,
    BlockRemoved,
    BlockStored,
    NoFreeBlocksError,
)

pytestmark = pytest.mark.unit

H = [bytes([i]) * 32 for i in range(8)]


def snapshot(bm: BlockManager):
    ids = range(bm.num_blocks)
    return (
        bm.free_block_ids(),
        [bm.ref_count(b) for b in ids],
        [bm.block_hash_of(b) for b in ids],
        bm.num_free_blocks,
        bm.num_used_blocks,
    )


def cached_and_freed(num_blocks: int, hashes: list[bytes]) -> BlockManager:
    """A manager whose first len(hashes) blocks were allocated, cached under `hashes` and freed."""
    bm = BlockManager(num_blocks, block_size=4)
    ids = bm.allocate(len(hashes))
    for block_id, block_hash in zip(ids, hashes, strict=True):
        bm.cache_block(block_id, block_hash)
    bm.free(ids)
    bm.drain_events()
    return bm


def test_initial_state():
    bm = BlockManager(5, block_size=4)
    assert (bm.num_blocks, bm.block_size, bm.enable_prefix_caching) == (5, 4, True)
    assert bm.free_block_ids() == [0, 1, 2, 3, 4]
    assert (bm.num_free_blocks, bm.num_used_blocks) == (5, 0)
    assert all(bm.ref_count(b) == 0 and bm.block_hash_of(b) is None for b in range(5))
    assert bm.drain_events() == []


def test_fresh_allocation_order():
    bm = BlockManager(5, block_size=4)
    assert bm.allocate(2) == [0, 1]
    assert bm.allocate(0) == []
    assert bm.allocate(3) == [2, 3, 4]
    assert bm.free_block_ids() == []
    assert (bm.num_free_blocks, bm.num_used_blocks) == (0, 5)
    assert [bm.ref_count(b) for b in range(5)] == [1, 1, 1, 1, 1]


def test_free_walks_blocks_in_reverse():
    bm = BlockManager(5, block_size=4)
    ids = bm.allocate(3)
    bm.free(ids)
    assert bm.free_block_ids() == [3, 4, 2, 1, 0]
    assert [bm.ref_count(b) for b in range(5)] == [0, 0, 0, 0, 0]
    assert bm.allocate(3) == [3, 4, 2]


def test_allocate_evicts_least_recently_used_cached_block():
    bm = BlockManager(4, block_size=4)
    ids = bm.allocate(2)
    bm.cache_block(0, H[0])
    bm.cache_block(1, H[1])
    bm.free(ids)
    assert bm.free_block_ids() == [2, 3, 1, 0]
    assert bm.drain_events() == [BlockStored((H[0], H[1]))]

    assert bm.allocate(2) == [2, 3]
    assert bm.drain_events() == []
    assert bm.allocate(1) == [1]
    assert bm.drain_events() == [BlockRemoved((H[1],))]
    assert bm.block_hash_of(1) is None
    assert bm.block_hash_of(0) == H[0]
    assert bm.lookup_prefix([H[0], H[1]]) == [0]
    assert bm.free_block_ids() == [0]


def test_one_allocation_evicting_several_blocks_batches_removals():
    bm = cached_and_freed(3, [H[0], H[1], H[2]])
    assert bm.free_block_ids() == [2, 1, 0]
    assert bm.allocate(2) == [2, 1]
    assert bm.drain_events() == [BlockRemoved((H[2], H[1]))]


def test_touch_takes_cached_free_block_out_of_free_list():
    bm = cached_and_freed(4, [H[0], H[1]])
    assert bm.free_block_ids() == [2, 3, 1, 0]
    hits = bm.lookup_prefix([H[0], H[1]])
    assert hits == [0, 1]
    assert bm.num_blocks_to_touch(hits) == 2

    bm.touch(hits)
    assert bm.free_block_ids() == [2, 3]
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    assert bm.lookup_prefix([H[0], H[1]]) == [0, 1]
    assert (bm.block_hash_of(0), bm.block_hash_of(1)) == (H[0], H[1])
    assert bm.num_blocks_to_touch(hits) == 0

    assert bm.allocate(2) == [2, 3]
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1)
    assert bm.drain_events() == []


def test_touched_then_freed_block_moves_to_most_recent_end():
    bm = cached_and_freed(4, [H[0], H[1]])
    assert bm.free_block_ids() == [2, 3, 1, 0]
    bm.touch([1])
    bm.free([1])
    assert bm.free_block_ids() == [2, 3, 0, 1]


def test_num_blocks_to_touch_counts_only_free_blocks_once():
    bm = cached_and_freed(4, [H[0], H[1]])
    bm.touch([0])
    assert bm.num_blocks_to_touch([0, 1]) == 1
    assert bm.num_blocks_to_touch([1, 1]) == 1
    assert bm.num_blocks_to_touch([]) == 0


def test_touch_of_uncached_block_raises_and_changes_nothing():
    bm = cached_and_freed(4, [H[0]])
    before = snapshot(bm)
    with pytest.raises(ValueError):
        bm.touch([0, 2])
    assert snapshot(bm) == before


def test_lookup_stops_at_first_miss():
    bm = BlockManager(5, block_size=4)
    bm.allocate(4)
    bm.cache_block(0, H[0])
    bm.cache_block(1, H[1])
    bm.cache_block(3, H[3])
    assert bm.lookup_prefix([H[0], H[1], H[2], H[3]]) == [0, 1]
    assert bm.lookup_prefix([H[2], H[0]]) == []
    assert bm.lookup_prefix([H[3]]) == [3]
    assert bm.lookup_prefix([]) == []


def test_lookup_has_no_side_effects():
    bm = cached_and_freed(4, [H[0], H[1]])
    before = snapshot(bm)
    assert bm.lookup_prefix([H[0], H[1]]) == [0, 1]
    assert snapshot(bm) == before
    assert bm.drain_events() == []


def test_shared_prefix_between_two_requests():
    bm = BlockManager(6, block_size=4)
    a = bm.allocate(3)
    assert a == [0, 1, 2]
    bm.cache_block(0, H[0])
    bm.cache_block(1, H[1])

    hits = bm.lookup_prefix([H[0], H[1]])
    assert hits == [0, 1]
    assert bm.num_blocks_to_touch(hits) == 0
    bm.touch(hits)
    b = hits + bm.allocate(1)
    assert b == [0, 1, 3]
    assert [bm.ref_count(x) for x in range(6)] == [2, 2, 1, 1, 0, 0]

    bm.free(a)
    assert [bm.ref_count(x) for x in range(6)] == [1, 1, 0, 1, 0, 0]
    assert bm.free_block_ids() == [4, 5, 2]
    assert bm.lookup_prefix([H[0], H[1]]) == [0, 1]

    bm.free(b)
    assert [bm.ref_count(x) for x in range(6)] == [0] * 6
    assert bm.free_block_ids() == [4, 5, 2, 3, 1, 0]
    assert bm.lookup_prefix([H[0], H[1]]) == [0, 1]


def test_duplicate_hash_keeps_first_mapping():
    bm = BlockManager(4, block_size=4)
    ids = bm.allocate(2)
    bm.cache_block(0, H[0])
    bm.cache_block(1, H[0])
    assert bm.block_hash_of(0) == H[0]
    assert bm.block_hash_of(1) is None
    assert bm.lookup_prefix([H[0]]) == [0]
    assert bm.drain_events() == [BlockStored((H[0],))]

    bm.free(ids)
    assert bm.free_block_ids() == [2, 3, 1, 0]
    assert bm.allocate(3) == [2, 3, 1]
    assert bm.drain_events() == []
    assert bm.lookup_prefix([H[0]]) == [0]


def test_caching_a_block_twice():
    bm = BlockManager(4, block_size=4)
    bm.allocate(1)
    bm.cache_block(0, H[0])
    bm.cache_block(0, H[0])
    assert bm.drain_events() == [BlockStored((H[0],))]
    with pytest.raises(ValueError):
        bm.cache_block(0, H[1])
    assert bm.lookup_prefix([H[1]]) == []


def test_caching_a_free_block_raises():
    bm = BlockManager(4, block_size=4)
    with pytest.raises(ValueError):
        bm.cache_block(0, H[0])
    assert bm.lookup_prefix([H[0]]) == []
    assert bm.drain_events() == []


def test_no_free_blocks_leaves_state_unchanged():
    bm = cached_and_freed(4, [H[0], H[1]])
    bm.allocate(1)
    bm.drain_events()
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError, match=r"need 4 free blocks, only 3 of 4"):
        bm.allocate(4)
    assert snapshot(bm) == before
    assert bm.lookup_prefix([H[0], H[1]]) == [0, 1]
    assert bm.drain_events() == []


def test_negative_allocation_raises():
    bm = BlockManager(4, block_size=4)
    with pytest.raises(ValueError):
        bm.allocate(-1)


def test_double_free_raises():
    bm = BlockManager(4, block_size=4)
    ids = bm.allocate(2)
    bm.free(ids)
    before = snapshot(bm)
    with pytest.raises(ValueError):
        bm.free([0])
    assert snapshot(bm) == before


def test_overfreeing_within_one_call_raises_and_changes_nothing():
    bm = BlockManager(4, block_size=4)
    bm.allocate(2)
    before = snapshot(bm)
    with pytest.raises(ValueError):
        bm.free([1, 0, 0])
    assert snapshot(bm) == before


def test_freeing_a_never_allocated_or_unknown_block_raises():
    bm = BlockManager(4, block_size=4)
    with pytest.raises(ValueError):
        bm.free([3])
    with pytest.raises(ValueError):
        bm.free([4])
    with pytest.raises(ValueError):
        bm.ref_count(-1)


def test_reset_prefix_cache_refuses_while_referenced():
    bm = BlockManager(4, block_size=4)
    ids = bm.allocate(2)
    bm.cache_block(0, H[0])
    bm.cache_block(1, H[1])
    bm.drain_events()
    assert bm.reset_prefix_cache() is False
    assert bm.lookup_prefix([H[0], H[1]]) == [0, 1]
    assert bm.drain_events() == []

    bm.free(ids)
    order = bm.free_block_ids()
    assert bm.reset_prefix_cache() is True
    assert bm.lookup_prefix([H[0], H[1]]) == []
    assert bm.block_hash_of(0) is None and bm.block_hash_of(1) is None
    assert bm.free_block_ids() == order
    assert bm.drain_events() == [AllBlocksCleared()]
    assert bm.allocate(4) == order
    assert bm.drain_events() == []


def test_caching_disabled():
    bm = BlockManager(4, block_size=4, enable_prefix_caching=False)
    ids = bm.allocate(2)
    bm.cache_block(0, H[0])
    assert bm.block_hash_of(0) is None
    assert bm.lookup_prefix([H[0]]) == []
    bm.free(ids)
    assert bm.free_block_ids() == [2, 3, 1, 0]
    assert bm.allocate(4) == [2, 3, 1, 0]
    bm.free([0, 1, 2, 3])
    assert bm.reset_prefix_cache() is True
    assert bm.drain_events() == []


def test_events_in_order():
    bm = BlockManager(3, block_size=4)
    ids = bm.allocate(2)
    bm.cache_block(0, H[0])
    bm.cache_block(1, H[1])
    bm.free(ids)
    assert bm.free_block_ids() == [2, 1, 0]
    b = bm.allocate(2)
    assert b == [2, 1]
    bm.cache_block(2, H[2])
    bm.cache_block(1, H[3])
    bm.allocate(1)
    bm.free(b + [0])
    assert bm.reset_prefix_cache() is True
    bm.allocate(1)
    assert bm.drain_events() == [
        BlockStored((H[0], H[1])),
        BlockRemoved((H[1],)),
        BlockStored((H[2], H[3])),
        BlockRemoved((H[0],)),
        AllBlocksCleared(),
    ]
    assert bm.drain_events() == []


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4)])
def test_invalid_sizes_are_rejected(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


# -- partial hits ---------------------------------------------------------------------------

CHAIN = b"c" * 32


def test_lookup_partial_finds_the_longest_common_start_under_the_chain():
    bm = BlockManager(6, block_size=4)
    a, b = bm.allocate(2)
    bm.cache_block(a, H[0], CHAIN, [5, 6, 7, 8])
    bm.cache_block(b, H[1], CHAIN, [5, 6, 9, 9])
    assert bm.lookup_partial(CHAIN, [5, 6, 7]) == (a, 3)
    assert bm.lookup_partial(CHAIN, [5, 6, 9, 1]) == (b, 3)
    assert bm.lookup_partial(CHAIN, [5, 1]) in ((a, 1), (b, 1))
    assert bm.lookup_partial(CHAIN, [4, 6]) is None  # no block begins with 4
    assert bm.lookup_partial(b"d" * 32, [5, 6]) is None  # another parent
    assert bm.lookup_partial(CHAIN, []) is None
    bm.free([a, b])
    assert bm.lookup_partial(CHAIN, [5, 6, 7]) == (a, 3)  # free but still cached


def test_an_evicted_block_leaves_the_partial_index():
    bm = BlockManager(2, block_size=4)
    a, b = bm.allocate(2)
    bm.cache_block(a, H[0], CHAIN, [5, 6, 7, 8])
    bm.keep_partial(b, CHAIN, [5, 6])  # a finished request's last block: 2 tokens of KV
    assert bm.lookup_partial(CHAIN, [5, 6, 7]) == (a, 3)
    bm.free([a, b])
    assert bm.allocate(1) == [b]  # the least recently freed (a request's blocks are freed tail first)
    assert bm.lookup_partial(CHAIN, [5, 6, 7]) == (a, 3)
    bm.allocate(1)
    assert bm.lookup_partial(CHAIN, [5, 6, 7]) is None
    assert (bm._children, bm._indexed) == ({}, {})


def test_keep_partial_skips_a_cached_or_shared_block_and_touch_takes_a_kept_one():
    bm = BlockManager(4, block_size=4)
    a, b = bm.allocate(2)
    bm.cache_block(a, H[0])
    bm.keep_partial(a, CHAIN, [1])  # cached already: its hash says what it holds
    bm.touch([a])
    bm.keep_partial(b, CHAIN, [2, 3])
    assert bm.lookup_partial(CHAIN, [1]) is None
    bm.free([b])
    assert bm.lookup_partial(CHAIN, [2, 3, 4]) == (b, 2)
    bm.touch([b])  # a partial hit's source, held until its copy is made
    assert bm.ref_count(b) == 1 and b not in bm.free_block_ids()
    bm.free([b])
    c = bm.allocate(1)[0]
    with pytest.raises(ValueError, match="not cached"):
        bm.touch([c])


def test_reset_prefix_cache_empties_the_partial_index():
    bm = BlockManager(2, block_size=4)
    a = bm.allocate(1)[0]
    bm.cache_block(a, H[0], CHAIN, [1, 2, 3, 4])
    bm.free([a])
    assert bm.reset_prefix_cache()
    assert bm.lookup_partial(CHAIN, [1, 2]) is None
