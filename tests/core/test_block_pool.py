"""BlockPool and FreeBlockQueue: null block, LRU eviction of cached blocks, touch, frees."""

import pytest

from paphos.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_o1_operations():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # from the middle
    assert ids(q) == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert ids(q) == [1, 3, 4, 2] and len(q) == 4
    with pytest.raises(ValueError):
        q.remove(blocks[0])  # not in the queue
    with pytest.raises(ValueError):
        q.append(blocks[3])  # already in the queue
    for _ in range(4):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_null_block_never_handed_out():
    pool = BlockPool(8)
    assert pool.num_free_blocks == 7
    got = pool.get_new_blocks(7)
    assert 0 not in ids(got) and sorted(ids(got)) == list(range(1, 8))
    assert pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    assert pool.num_free_blocks == 7 and pool.usage == 0.0
    assert pool.null_block not in list(pool.free_queue)


def test_too_few_blocks_rejected():
    with pytest.raises(ValueError):
        BlockPool(1)


def test_lru_evicts_least_recently_freed_cached_block():
    pool = BlockPool(4)  # usable: 1, 2, 3
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a, b, c], [101, 102, 103])
    pool.free_blocks([b])
    pool.free_blocks([c])
    pool.free_blocks([a])
    assert ids(pool.free_queue) == [b.block_id, c.block_id, a.block_id]
    assert all(pool.get_cached_block(h) is not None for h in (101, 102, 103))
    (first,) = pool.get_new_blocks(1)
    assert first is b  # freed first -> evicted first
    assert pool.get_cached_block(102) is None and b.block_hash is None
    assert pool.get_cached_block(103) is c and pool.get_cached_block(101) is a


def test_touch_removes_cached_hit_from_free_queue():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a], [7])
    pool.free_blocks([a, b, c])
    hit = pool.get_cached_block(7)
    assert hit is a
    pool.touch([hit])
    assert a.ref_cnt == 1 and a not in list(pool.free_queue)
    # The hit is not evictable: the next two allocations take the other blocks.
    assert set(ids(pool.get_new_blocks(2))) == {b.block_id, c.block_id}
    assert pool.get_cached_block(7) is a
    # Touching a held block only adds a reference; a re-freed hit goes to the tail (most recent).
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.free_blocks([a])
    assert ids(pool.free_queue) == [a.block_id]


def test_double_free_raises():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError):
        pool.free_blocks([a])


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [5])
    pool.cache_full_blocks([b], [5])
    assert pool.get_cached_block(5) is a and b.block_hash is None


def test_caching_disabled_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], [5])
    assert pool.get_cached_block(5) is None and a.block_hash is None


def test_reset_prefix_cache():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [1, 2])
    pool.free_blocks([a])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) is None
    assert a.block_hash is None and b.block_hash is None
    assert pool.num_free_blocks == 2
