"""Scheduler: token budget, chunked prefill, mixed steps, preemption, abort, rejection."""

import pytest
from core_fakes import FakeRunner, check_invariants, make_request, make_scheduler, run_to_completion, step

from paphos.request import RequestStatus


def test_chunked_prefill_respects_token_budget_and_max_num_seqs():
    s = make_scheduler(max_num_batched_tokens=10, max_num_seqs=2, num_blocks=64)
    runner = FakeRunner(4)
    for i in range(3):
        s.add_request(make_request(f"r{i}", list(range(100 * i, 100 * i + 8))))
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"r0": 8, "r1": 2}  # r1 gets the leftover as a chunk
    assert out.total_num_scheduled_tokens == 10 and s.num_running == 2 and s.num_waiting == 1
    out, outputs = step(s, runner)
    # r0 decodes (1 token), r1 continues its prefill (6 left); r2 waits: max_num_seqs is 2.
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 6}
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["r0", "r1"] and not out.scheduled_new_reqs
    assert {o.req_id for o in outputs} == {"r0", "r1"}


def test_decode_row_and_prefill_chunk_share_a_step():
    s = make_scheduler(max_num_batched_tokens=6)
    runner = FakeRunner(4)
    s.add_request(make_request("a", [1, 2, 3]))
    out, outputs = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 3} and len(outputs[0].new_token_ids) == 1
    s.add_request(make_request("b", list(range(10, 30))))
    out, outputs = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    assert [o.req_id for o in outputs] == ["a"]  # b's partial prefill samples nothing
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}
    assert out.scheduled_cached_reqs[1].num_computed_tokens == 5


def test_without_chunked_prefill_a_prefill_that_does_not_fit_waits():
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    runner = FakeRunner(4)
    s.add_request(make_request("a", [1, 2, 3]))
    step(s, runner)
    s.add_request(make_request("b", list(range(16))))
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 1}  # b needs 16, only 15 left: no chunk
    assert s.num_waiting == 1


def test_preemption_when_blocks_run_out_and_resume_first():
    # 6 usable blocks of 4 tokens; two requests of 8-token prompts growing to 8 + 12 tokens.
    s = make_scheduler(num_blocks=7, block_size=4, max_num_seqs=2, enable_prefix_caching=False)
    runner = FakeRunner(4)
    s.add_request(make_request("old", list(range(8)), max_tokens=12))
    s.add_request(make_request("new", list(range(50, 58)), max_tokens=12))
    s.add_request(make_request("later", [7, 7], max_tokens=2))
    preempted_at = None
    for i in range(40):
        out, _ = step(s, runner)
        if out.preempted_req_ids:
            preempted_at = i
            break
    assert out.preempted_req_ids == {"new"}  # the newest running request is the victim
    new = next(iter(s.waiting))
    assert new.request_id == "new" and new.status == RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0 and new.num_output_tokens > 0  # output kept
    assert s.num_preemptions_total == 1 and new.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["new", "later"]  # front of the queue
    assert not out.scheduled_new_reqs  # no admissions in a step that preempted
    assert preempted_at is not None
    # On resumption it arrives whole (prompt + output so far), before "later".
    output_before = list(new.output_token_ids)
    while True:
        out, _ = step(s, runner)
        if out.scheduled_new_reqs:
            break
    first = out.scheduled_new_reqs[0]
    assert first.req_id == "new" and first.output_token_ids == output_before
    assert first.prompt_token_ids == list(range(50, 58))
    run_to_completion(s, runner)
    assert s.kv_cache_manager.num_free_blocks == 6


def _greedy_run(num_blocks: int, prompts: dict[str, list[int]], **kw) -> tuple[dict, int]:
    s = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, **kw)
    runner = FakeRunner(4)
    for rid, prompt in prompts.items():
        s.add_request(make_request(rid, prompt, max_tokens=20))
    return run_to_completion(s, runner), s.num_preemptions_total


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_and_resume_give_identical_greedy_outputs(caching):
    prompts = {f"r{i}": [i] * (3 + 5 * i) + list(range(i)) for i in range(5)}
    prompts["dup"] = list(prompts["r2"])  # a shared prefix, to exercise hits after preemption
    big, big_preempt = _greedy_run(200, prompts, enable_prefix_caching=caching)
    tiny, tiny_preempt = _greedy_run(13, prompts, enable_prefix_caching=caching)
    assert big_preempt == 0 and tiny_preempt > 0
    assert tiny == big
    assert all(len(v) == 20 for v in big.values())


def test_abort_frees_every_block():
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=12)
    runner = FakeRunner(4)
    for i in range(4):
        s.add_request(make_request(f"r{i}", list(range(i, i + 9)), max_tokens=50))
    step(s, runner)
    step(s, runner)
    assert s.num_running >= 2 and s.num_waiting >= 1 and s.kv_usage > 0
    s.finish_requests(["r0", "r3", "unknown"], RequestStatus.FINISHED_ABORTED)
    check_invariants(s)
    s.finish_requests("r0", RequestStatus.FINISHED_ABORTED)  # already finished: no error
    s.finish_requests(
        [r.request_id for r in list(s.running) + list(s.waiting)], RequestStatus.FINISHED_ABORTED
    )
    check_invariants(s)
    assert s.kv_usage == 0.0 and s.kv_cache_manager.num_free_blocks == 31
    assert not s.has_unfinished_requests() and s.get_num_unfinished_requests() == 0
    out = s.schedule()
    assert out.finished_req_ids == {"r0", "r1", "r2", "r3"} and out.is_empty
    assert s.schedule().finished_req_ids == set()
    with pytest.raises(ValueError):
        s.finish_requests("r1", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_ignored_by_update():
    s = make_scheduler()
    runner = FakeRunner(4)
    s.add_request(make_request("a", [1, 2, 3]))
    out = s.schedule()
    result = runner.execute(out)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert list(s.update_from_output(out, result)) == []
    check_invariants(s)


def test_prompt_that_cannot_fit_is_rejected_not_looped():
    s = make_scheduler(num_blocks=3, block_size=4, max_model_len=64)  # the pool holds 8 tokens
    runner = FakeRunner(4)
    s.add_request(make_request("huge", list(range(9))))
    s.add_request(make_request("long", list(range(65))))
    s.add_request(make_request("ok", list(range(5)), max_tokens=16))
    assert s.has_unfinished_requests() and s.get_num_unfinished_requests() == 1
    finals, tokens = {}, []
    while s.has_unfinished_requests():
        _, outputs = step(s, runner)
        finals.update({o.req_id: o.finish_reason for o in outputs if o.finished})
        tokens += [t for o in outputs if o.req_id == "ok" for t in o.new_token_ids]
    assert finals == {"huge": "abort", "long": "abort", "ok": "length"}
    # "ok" stops at the pool's capacity (8 tokens) instead of preempting itself forever.
    assert len(tokens) == 3 and s.num_preemptions_total == 0


def test_rejection_is_reported_by_an_empty_step():
    s = make_scheduler(num_blocks=3, block_size=4)
    s.add_request(make_request("huge", list(range(9))))
    out = s.schedule()
    assert out.is_empty
    (o,) = s.update_from_output(out, None)
    assert o.req_id == "huge" and o.finish_reason == "abort" and o.new_token_ids == []
    assert not s.has_unfinished_requests()


def test_duplicate_request_id_raises():
    s = make_scheduler()
    s.add_request(make_request("a", [1]))
    with pytest.raises(ValueError):
        s.add_request(make_request("a", [2]))


def test_same_step_prefix_sharing_and_metrics():
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=64)
    runner = FakeRunner(4)
    prompt = list(range(10))
    for i in range(3):  # swipes: n=3 becomes three requests with one prompt
        s.add_request(make_request(f"s{i}", prompt))
    out, _ = step(s, runner)
    assert out.num_scheduled_tokens == {"s0": 10, "s1": 2, "s2": 2}
    tables = [n.block_ids for n in out.scheduled_new_reqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert s.prefix_cache_queries == 30 and s.prefix_cache_hits == 16
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == [0, 8, 8]
    run_to_completion(s, runner)


def test_prompt_logprobs_are_not_repeated_after_preemption():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=6)
    runner = FakeRunner(4, prompt_logprobs=True)
    s.add_request(make_request("p", list(range(9)), prompt_logprobs=1, max_tokens=8))
    s.add_request(make_request("q", list(range(20, 29)), max_tokens=8))
    positions = []
    while s.has_unfinished_requests():
        _, outputs = step(s, runner)
        for o in outputs:
            if o.req_id == "p" and o.new_prompt_logprobs:
                positions += [e.rank for e in o.new_prompt_logprobs]
    assert s.num_preemptions_total > 0
    assert positions == list(range(1, 9))  # each prompt position once, in order
