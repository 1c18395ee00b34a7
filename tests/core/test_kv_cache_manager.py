"""KVCacheManager: prefix hits, the never-the-whole-prompt cap, allocation accounting, frees."""

from core_fakes import make_request

from paphos.core.kv_cache_manager import KVCacheManager

BS = 4


def admit(kv: KVCacheManager, req):
    """What the scheduler does on admission: lookup, allocate, mark the hits computed."""
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return hits, num_hit_tokens


def test_prefix_hit_reuses_the_same_block_ids():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = make_request("a", prompt)
    admit(kv, a)
    b = make_request("b", prompt + [50, 51, 52])
    hits, n = admit(kv, b)
    assert n == 8 and [h.block_id for h in hits] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[2] != kv.get_block_ids("a")[2]
    assert all(blk.ref_cnt == 2 for blk in hits)


def test_hit_survives_free_and_is_capped_below_whole_prompt():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(8))  # exactly 2 blocks
    a = make_request("a", prompt)
    admit(kv, a)
    a_ids = kv.get_block_ids("a")
    kv.free(a)
    assert kv.num_free_blocks == 15
    b = make_request("b", prompt)
    hits, n = kv.get_computed_blocks(b)
    # The last token must be computed to get logits: only the first block may hit.
    assert n == 4 and [h.block_id for h in hits] == a_ids[:1]


def test_prompt_logprobs_skip_lookup_but_populate():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(9))
    a = make_request("a", prompt, prompt_logprobs=1)
    admit(kv, a)
    b = make_request("b", prompt, prompt_logprobs=0)
    assert kv.get_computed_blocks(b) == ([], 0)
    c = make_request("c", prompt)
    assert kv.get_computed_blocks(c)[1] == 8
    assert kv.block_pool.get_cached_block(a.block_hashes[1]) is not None


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    assert kv.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_allocate_accounts_for_computed_tokens_and_fails_cleanly():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable blocks
    a = make_request("a", list(range(6)))
    assert len(kv.allocate_slots(a, 5)) == 2
    a.num_computed_tokens = 5
    assert kv.allocate_slots(a, 1) == []  # token 6 still fits in block 2
    a.num_computed_tokens = 6
    a.append_output_token_ids([1, 2, 3])
    assert len(kv.allocate_slots(a, 3)) == 1  # 9 slots -> 3 blocks
    b = make_request("b", list(range(100, 109)))
    before = kv.num_free_blocks
    assert kv.allocate_slots(b, 9) is None
    assert kv.num_free_blocks == before and kv.get_block_ids("b") == []
    assert "b" not in kv.req_to_blocks


def test_free_cached_hits_count_against_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = make_request("a", list(range(9)))  # 3 blocks
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(9)) + [7, 7, 7])  # 2 hits (free) + needs 1 more block
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # 2 free hits + 1 new block = 3 <= 3 free: fits, and the hits are not evicted by the new one.
    new = kv.allocate_slots(b, b.num_tokens - n, hits)
    assert new is not None and len(new) == 1
    assert kv.get_block_ids("b")[:2] == [h.block_id for h in hits]
    kv.free(b)
    c = make_request("c", list(range(9)) + [8] * 7)  # 2 free hits + 2 new = 4 > 3
    hits, n = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - n, hits) is None
    assert all(h.ref_cnt == 0 for h in hits) and kv.num_free_blocks == 3


def test_free_evicts_the_sequence_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(13)))  # 4 blocks, 3 full (cached)
    admit(kv, a)
    a_ids = kv.get_block_ids("a")
    kv.free(a)
    free_order = [b.block_id for b in kv.block_pool.free_queue]
    # Never-used blocks first, then a's blocks tail first, its first (most shareable) block last.
    assert free_order[-4:] == a_ids[::-1]
    b = make_request("b", [99] * 16)
    kv.allocate_slots(b, 16)
    # b took the 3 never-used blocks and a's tail block; a's 3 cached prefix blocks still hit.
    assert kv.get_computed_blocks(make_request("c", list(range(13))))[1] == 12


def test_usage_and_free_is_idempotent():
    kv = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    assert kv.usage == 0.5
    kv.free(a)
    kv.free(a)
    assert kv.usage == 0.0
