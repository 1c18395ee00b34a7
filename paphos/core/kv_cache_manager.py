"""KV cache manager: which blocks each request holds, prefix-cache lookup, slot allocation.

Data flow: the scheduler calls `get_computed_blocks` when it admits a waiting request (how much of
its prefix is already in the cache), `allocate_slots` for every request it schedules (enough
blocks for the tokens computed after this step), and `free` when a request finishes or is
preempted. The block ids it hands out go to the model runner inside `SchedulerOutput`.

Prefix caching: a block is registered in the cache as soon as the slots of this step's allocation
make it full (all its tokens are known at scheduling time). Its KV is written during the same step,
so a request admitted in the same step may already hit it: the model runner must write all of a
step's K/V into the cache before any row of that step attends (per layer), which a flat batch
does naturally.
"""

from __future__ import annotations

from collections.abc import Hashable

from paphos.core.block_pool import BlockPool, KVCacheBlock
from paphos.core.prefix_hash import compute_block_hashes
from paphos.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Blocks of each request, in sequence order (block i holds tokens i*bs .. (i+1)*bs - 1).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    # ---- queries -------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def max_tokens_in_pool(self) -> int:
        """Tokens one request could hold if it had every usable block to itself."""
        return self.block_pool.num_usable_blocks * self.block_size

    def get_blocks(self, req_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(req_id, [])

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, [])]

    def _extra_keys(self, request: Request) -> tuple[Hashable, ...]:
        # Keys besides the tokens that change a block's KV: an adapter changes every layer's
        # K/V, so two adapters (or an adapter and the base) never share blocks.
        return (request.lora_id,) if request.lora_id else ()

    # ---- prefix cache --------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks of the request's known tokens, and its length.

        Never the whole sequence: at least the last token must be computed so that the step
        produces logits to sample from, hence the cap at num_tokens - 1 (rounded down to a block).
        Requests asking for prompt logprobs get no hits: every prompt position needs its logits.
        Nothing is reserved here; `allocate_slots(..., new_computed_blocks)` takes the references.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = compute_block_hashes(request, self.block_size, self._extra_keys(request))
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_cache_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count a lookup in the hit-rate metric (called once per successful admission, so a
        request that waits several steps for blocks is not counted several times)."""
        if self.enable_caching and request.sampling_params.prompt_logprobs is None:
            self.block_pool.record_prefix_cache_query(request.num_tokens, num_hit_tokens)

    # ---- allocation ----------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make the request hold enough blocks for the tokens it will have computed after this
        step: request.num_computed_tokens + prefix-cache hits + num_new_tokens.

        `new_computed_blocks` are this admission's prefix-cache hits (from `get_computed_blocks`),
        not yet counted in request.num_computed_tokens. Returns the newly allocated blocks (hits
        excluded), or None, changing nothing, when the pool has too few free blocks.
        """
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_total_tokens = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_required = -(-num_total_tokens // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(hits))
        # A hit on a free cached block takes it out of the free queue, so it costs a free block.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.block_pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None

        if hits:
            # Touch before taking new blocks, or get_new_blocks could evict the very hits.
            self.block_pool.touch(hits)
            blocks.extend(hits)
            # Hits come only at admission, so they are the leading blocks, already registered.
            self.num_cached_blocks[request.request_id] = len(blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)

        if self.enable_caching:
            self._cache_full_blocks(request, min(num_total_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        req_id = request.request_id
        num_cached = self.num_cached_blocks.get(req_id, 0)
        num_full = num_tokens_after_step // self.block_size
        if num_full <= num_cached:
            return
        hashes = compute_block_hashes(request, self.block_size, self._extra_keys(request))
        blocks = self.req_to_blocks[req_id]
        self.block_pool.cache_full_blocks(blocks[num_cached:num_full], hashes[num_cached:num_full])
        self.num_cached_blocks[req_id] = num_full

    def truncate(self, request: Request, num_computed_tokens: int) -> None:
        """Keep only the blocks wholly before `num_computed_tokens` (a multiple of the block size)
        after a phrase-ban rollback. Later blocks are given back rather than rewritten in place: a
        full one may be registered in the prefix cache under the hash of the dropped tokens, and
        stays valid there. The request's block hashes are cut to its (shorter) full blocks."""
        keep = num_computed_tokens // self.block_size
        blocks = self.req_to_blocks.get(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks[keep:]))
        del blocks[keep:]
        if request.request_id in self.num_cached_blocks:
            self.num_cached_blocks[request.request_id] = min(self.num_cached_blocks[request.request_id], keep)
        del request.block_hashes[request.num_tokens // self.block_size :]

    def free(self, request: Request) -> None:
        """Give back every block of the request (finish, abort or preemption). Idempotent."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        # Reverse order: the sequence's tail blocks are evicted before its (shareable) prefix.
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
