"""Test doubles for the engine core: a fake model runner over a fake paged KV cache, request
builders and the block-accounting invariants.

The fake runner plays the real runner's side of the `SchedulerOutput` contract: it keeps its own
per-request state (tokens, block table, computed count), appends the tokens it samples itself,
writes every scheduled token's "KV" into the slots the block table names before any row reads, and
checks that every position a row attends to holds the KV of exactly that prefix. Its "model" is a
pure function of what it reads from the cache, so a wrong block table or a bad prefix-cache hit
changes the output (or trips an assertion).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from paphos.config import CacheConfig, SchedulerConfig
from paphos.core.scheduler import Scheduler
from paphos.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from paphos.request import Request
from paphos.sampling_params import SamplingParams

VOCAB = 97


def make_request(
    req_id: str,
    prompt: list[int],
    eos_token_id: int | None = None,
    extra_eos_token_ids: tuple[int, ...] = (),
    **params: object,
) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(
        req_id, prompt, SamplingParams(**params), eos_token_id=eos_token_id, extra_eos_token_ids=extra_eos_token_ids
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 64,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    max_loras: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            max_model_len=max_model_len,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        num_blocks,
        max_loras=max_loras,
    )


@dataclass
class _RunnerReq:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    prompt_len: int
    # keys[p]: identity of the prefix tokens[:p+1], i.e. what the KV at position p depends on.
    keys: list[int] = field(default_factory=list)

    def key(self, p: int) -> int:
        while len(self.keys) <= p:
            prev = self.keys[-1] if self.keys else 0
            self.keys.append(hash((prev, self.tokens[len(self.keys)])))
        return self.keys[p]


SampleFn = Callable[[str, list[int], int], int]


class FakeRunner:
    def __init__(self, block_size: int, sample_fn: SampleFn | None = None, prompt_logprobs: bool = False):
        self.block_size = block_size
        # sample_fn(req_id, tokens so far, kv value read at the last position) -> next token.
        self.sample_fn = sample_fn or (lambda _rid, _toks, last_kv: last_kv % VOCAB)
        self.prompt_logprobs = prompt_logprobs
        self.kv: dict[int, int] = {}
        self.reqs: dict[str, _RunnerReq] = {}
        self.num_steps = 0

    def _slot(self, st: _RunnerReq, p: int) -> int:
        block_id = st.block_ids[p // self.block_size]
        assert block_id != 0, "the null block must never hold real tokens"
        return block_id * self.block_size + p % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new while the runner holds it"
            self.reqs[new.req_id] = _RunnerReq(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                len(new.prompt_token_ids),
            )
        for cached in out.scheduled_cached_reqs:
            st = self.reqs[cached.req_id]
            assert st.num_computed == cached.num_computed_tokens
            st.block_ids.extend(cached.new_block_ids)
        order = list(out.num_scheduled_tokens)
        assert order == [c.req_id for c in out.scheduled_cached_reqs] + [
            n.req_id for n in out.scheduled_new_reqs
        ]
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())

        # Write every scheduled token's KV first (flat batch), then attend.
        for rid, n in out.num_scheduled_tokens.items():
            st = self.reqs[rid]
            assert n >= 1 and st.num_computed + n <= len(st.tokens)
            assert len(st.block_ids) * self.block_size >= st.num_computed + n
            assert len(set(st.block_ids)) == len(st.block_ids)
            for p in range(st.num_computed, st.num_computed + n):
                self.kv[self._slot(st, p)] = st.key(p)

        result = ModelRunnerOutput(req_ids=order, sampled_token_ids=[], sampled_logprobs=[])
        for rid, n in out.num_scheduled_tokens.items():
            st = self.reqs[rid]
            start, end = st.num_computed, st.num_computed + n
            for p in range(end):
                assert self.kv.get(self._slot(st, p)) == st.key(p), f"{rid}: wrong KV at position {p}"
            st.num_computed = end
            if self.prompt_logprobs:
                # One entry per prompt position scored: start+1 .. end, within 1 .. prompt_len-1.
                positions = range(start + 1, min(end, st.prompt_len - 1) + 1)
                if positions:
                    entries = [TokenLogprobs(st.tokens[q], -1.0, q, [], []) for q in positions]
                    result.prompt_logprobs[rid] = entries
            if end == len(st.tokens):
                token = self.sample_fn(rid, st.tokens, self.kv[self._slot(st, end - 1)])
                st.tokens.append(token)
                result.sampled_token_ids.append([token])
                result.sampled_logprobs.append([-0.5])
            else:
                result.sampled_token_ids.append([])
                result.sampled_logprobs.append([])
        return result


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list]:
    out = scheduler.schedule()
    outputs = list(scheduler.update_from_output(out, runner.execute(out)))
    check_invariants(scheduler)
    return out, outputs


def run_to_completion(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000
) -> dict[str, list[int]]:
    """Steps until nothing is unfinished; returns each request's generated tokens."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return tokens
        _, outputs = step(scheduler, runner)
        for o in outputs:
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
    raise AssertionError("scheduler did not finish")


def check_invariants(scheduler: Scheduler) -> None:
    """No leak, no double free: ref counts match the block tables of the running requests."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    running_ids = {r.request_id for r in scheduler.running}
    assert set(kv.req_to_blocks) == running_ids, "only running requests hold blocks"
    held = sum(len(blocks) for blocks in kv.req_to_blocks.values())
    assert sum(b.ref_cnt for b in pool.blocks) == held
    for rid, blocks in kv.req_to_blocks.items():
        assert pool.null_block not in blocks
        assert len({b.block_id for b in blocks}) == len(blocks), f"{rid} holds a block twice"
    used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert used + pool.num_free_blocks == pool.num_blocks - 1
    free = list(pool.free_queue)
    assert len(free) == pool.num_free_blocks
    assert all(b.ref_cnt == 0 for b in free) and pool.null_block not in free
    assert pool.null_block.ref_cnt == 0
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    assert len(scheduler.running) <= scheduler.max_num_seqs
    for req in scheduler.waiting:
        assert req.request_id not in kv.req_to_blocks and req.num_computed_tokens == 0
