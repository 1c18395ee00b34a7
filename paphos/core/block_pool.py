"""Block pool: every KV cache block, who holds it, and the LRU of free (possibly cached) blocks.

Data flow: the KV cache manager asks the pool for blocks when the scheduler allocates slots and
gives them back when a request finishes or is preempted. Only block *ids* leave the core (in
`SchedulerOutput` block tables); the model runner owns the tensors they index.

A free block keeps its prefix-cache hash until it is handed out again, so a later request with the
same prefix can take it back (a "hit"). The free queue is therefore also the eviction order:
blocks are handed out from the head (least recently freed first) and returned to the tail.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's paged KV tensor."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        # Number of requests whose block table holds this block; 0 means it is in the free queue.
        self.ref_cnt = 0
        # Prefix-cache key once the block is full and registered; None otherwise.
        self.block_hash: int | None = None
        # Links of the free queue (None while the block is not in it).
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and removal from the middle.

    A prefix-cache hit on a free block removes it from wherever it sits, which a deque cannot do in
    O(1); the links live in the blocks themselves, so no node objects are allocated.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels: the list is never empty at the link level, so no edge cases on insert/remove.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("popleft from an empty free block queue")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All `num_blocks` blocks; block 0 is the reserved null block and is never handed out.

    The null block pads block tables (the runner fills unused entries with 0), so nothing real may
    ever be written there.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        # One block per hash: if two requests fill identical blocks at the same time, the second
        # block simply stays unregistered (its KV is valid but nobody will look it up).
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}
        # Prefix-cache statistics in tokens (a metric: hit rate = hits / queries).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached or not (cached free blocks are evictable, so they count)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue (LRU eviction of cached ones)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop the block's prefix-cache entry: its slots are about to be overwritten."""
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def cache_full_blocks(self, blocks: Iterable[KVCacheBlock], block_hashes: Iterable[int]) -> None:
        """Register newly full blocks under their hashes so later requests can hit them."""
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue (not evictable)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 go to the free queue tail in the given
        order, so the first ones given are evicted first. The KV cache manager passes a request's
        blocks in *reverse*: a sequence's tail blocks are the least likely to be shared by a later
        request (shared prefixes are at the front), so they should be reused first."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change). Blocks held by running requests
        keep their contents; they just can no longer be found by hash."""
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()

    def record_prefix_cache_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_queried_tokens
        self.prefix_cache_hits += num_hit_tokens
