"""Property test: random sequences of add / step / abort / stop-string finish never leak or
double-free a block, and the fake runner's KV checks hold at every step (so prefix hits,
preemption and chunking always give each row exactly its own prefix's KV).

A flat list of actions is drawn (rather than a RuleBasedStateMachine, whose swarm testing mostly
produced runs of one rule only), so adds, steps and aborts interleave in every example.
"""

import random

from core_fakes import VOCAB, FakeRunner, check_invariants, make_request, make_scheduler
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from paphos.request import RequestStatus

EOS = 0

configs = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(3, 16),
        "block_size": st.sampled_from([1, 2, 4]),
        "max_num_batched_tokens": st.integers(1, 24),
        "max_num_seqs": st.integers(1, 8),
        "max_model_len": st.integers(4, 32),
        "enable_chunked_prefill": st.booleans(),
        "enable_prefix_caching": st.booleans(),
    }
)
add_action = st.tuples(
    st.just("add"),
    st.integers(0, 12),  # length of the shared prefix taken from a common base prompt
    st.lists(st.integers(0, 3), max_size=8),  # own tail
    st.none() | st.integers(1, 16),  # max_tokens
    st.booleans(),  # ignore_eos
    st.none() | st.just(1),  # prompt_logprobs
)
step_action = st.tuples(st.just("step"), st.integers(1, 12))
finish_action = st.tuples(
    st.just("finish"),
    st.integers(0, 10**6),  # picks one unfinished request, or an unknown id
    st.sampled_from([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]),
)
reset_action = st.tuples(st.just("reset"), st.integers(0, 9))  # resets only on 0: rare
actions = st.lists(
    st.one_of(add_action, add_action, step_action, step_action, step_action, finish_action, reset_action),
    min_size=20,
    max_size=80,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, actions=actions, seed=st.integers(0, 2**32 - 1))
def test_random_actions_never_leak_or_double_free(config, actions, seed):
    if not config["enable_chunked_prefill"]:
        config["max_num_batched_tokens"] = max(config["max_num_batched_tokens"], config["max_model_len"])
    s = make_scheduler(**config)
    rng = random.Random(seed)
    # Mostly small ids so outputs repeat and share prefixes; EOS and the stop id 3 are rare enough
    # that sequences grow and run the pool dry (preemption).
    choices = [1, 2] * 8 + [EOS, 3]
    runner = FakeRunner(
        config["block_size"],
        sample_fn=lambda *_: rng.choice(choices) if rng.random() < 0.8 else rng.randrange(VOCAB),
    )
    base = [rng.randrange(4) for _ in range(12)]
    finished: set[str] = set()
    for i, action in enumerate(actions):
        kind = action[0]
        if kind == "add":
            _, prefix_len, tail, max_tokens, ignore_eos, prompt_logprobs = action
            req = make_request(
                f"r{i}",
                (base[:prefix_len] + tail) or [1],
                eos_token_id=EOS,
                max_tokens=max_tokens,
                ignore_eos=ignore_eos,
                prompt_logprobs=prompt_logprobs,
                stop_token_ids=[3],
            )
            s.add_request(req)
        elif kind == "step":
            for _ in range(action[1]):
                out = s.schedule()
                if out.preempted_req_ids:
                    event("preemption")
                if any(n.num_computed_tokens for n in out.scheduled_new_reqs):
                    event("prefix-cache hit")
                # Nothing scheduled while work waits would be a stall (the loop spinning forever).
                if s.num_running or s.num_waiting:
                    assert not out.is_empty
                for o in s.update_from_output(out, runner.execute(out)):
                    assert o.req_id not in finished, "output after finish"
                    if o.finished:
                        finished.add(o.req_id)
                check_invariants(s)
        elif kind == "finish":
            # Abort, or a stop string found by the detokenizer; unknown ids must be ignored.
            ids = sorted(s.requests) + ["unknown"]
            req_id = ids[action[1] % len(ids)]
            s.finish_requests(req_id, action[2])
            finished.add(req_id)
        elif action[1] == 0:
            s.reset_prefix_cache()
        check_invariants(s)

    s.finish_requests(list(s.requests), RequestStatus.FINISHED_ABORTED)
    check_invariants(s)
    pool = s.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks - 1 and s.kv_usage == 0.0
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_runs_to_completion_without_stalling():
    """Every request finishes in bounded steps whatever the pool size (no livelock)."""
    for num_blocks in (2, 3, 5, 9):
        for seed in range(5):
            rng = random.Random(seed)
            s = make_scheduler(
                num_blocks=num_blocks, block_size=2, max_num_batched_tokens=5, max_model_len=16
            )
            runner = FakeRunner(2, sample_fn=lambda *_, rng=rng: rng.randrange(1, VOCAB))
            for i in range(6):
                s.add_request(make_request(f"r{i}", [rng.randrange(3) for _ in range(rng.randrange(1, 8))]))
            for _ in range(2000):
                if not s.has_unfinished_requests():
                    break
                out = s.schedule()
                s.update_from_output(out, runner.execute(out))
                check_invariants(s)
            assert not s.has_unfinished_requests()
