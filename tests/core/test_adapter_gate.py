"""The scheduler and LoRA adapters: at most --max-loras distinct adapters run at once, a request
waiting for a slot is never starved, and adapters never share KV blocks."""

from __future__ import annotations

import random

from paphos.core.protocol import LoRARequest
from paphos.request import Request
from paphos.sampling_params import SamplingParams
from tests.core.core_fakes import FakeRunner, check_invariants, make_scheduler, step


def _request(req_id: str, lora_id: int, prompt: list[int] | None = None, max_tokens: int = 4) -> Request:
    lora = LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}") if lora_id else None
    return Request(req_id, prompt or [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens), None, lora=lora)


def _running_adapters(scheduler) -> set[int]:
    return {r.lora_id for r in scheduler.running if r.lora_id}


def test_running_requests_never_use_more_adapters_than_slots_and_all_finish() -> None:
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=8, max_loras=2)
    runner = FakeRunner(block_size=4)
    ids = [rng.choice([0, 1, 2, 3, 4, 5]) for _ in range(40)]
    for i, lora_id in enumerate(ids):
        scheduler.add_request(_request(f"r{i}", lora_id, max_tokens=rng.randint(1, 6)))
    finished: set[str] = set()
    for _ in range(500):
        if not scheduler.has_unfinished_requests():
            break
        out, outputs = step(scheduler, runner)
        step_adapters = {scheduler.requests[r].lora_id for r in out.num_scheduled_tokens if r in scheduler.requests}
        assert len(step_adapters - {0}) <= 2
        assert len(_running_adapters(scheduler)) <= 2
        finished |= {o.req_id for o in outputs if o.finished}
    assert finished == {f"r{i}" for i in range(40)}


def test_request_waiting_for_a_slot_is_not_starved_by_a_busy_adapter() -> None:
    """Adapter 1 gets a new request every step; the request for adapter 3 (no slot: 1 and 2 run)
    still starts within a bounded number of steps, because adapter 2's slot is drained."""
    scheduler = make_scheduler(num_blocks=512, max_num_seqs=16, max_loras=2)
    runner = FakeRunner(block_size=4)
    scheduler.add_request(_request("one-0", 1, max_tokens=6))
    scheduler.add_request(_request("two", 2, max_tokens=6))
    step(scheduler, runner)
    scheduler.add_request(_request("three", 3))
    started_at = None
    for i in range(1, 40):
        scheduler.add_request(_request(f"one-{i}", 1, max_tokens=6))
        out, _ = step(scheduler, runner)
        if "three" in {n.req_id for n in out.scheduled_new_reqs}:
            started_at = i
            break
    assert started_at is not None and started_at <= 8
    assert len(_running_adapters(scheduler)) <= 2


def test_busy_adapter_requests_overtake_a_request_waiting_for_a_slot() -> None:
    """Passing over: requests of running adapters and of the base behind a blocked request start
    (throughput), in order, and the blocked one keeps its place at the head."""
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=16, max_loras=1)
    runner = FakeRunner(block_size=4)
    scheduler.add_request(_request("a", 1, max_tokens=8))
    step(scheduler, runner)
    scheduler.add_request(_request("b", 2))
    scheduler.add_request(_request("base", 0))
    scheduler.add_request(_request("a2", 1))
    out, _ = step(scheduler, runner)
    new = [n.req_id for n in out.scheduled_new_reqs]
    # Adapter 1 is the only one running, so it is drained: a2 waits with b; the base starts.
    assert new == ["base"]
    assert [r.request_id for r in scheduler.waiting] == ["b", "a2"]
    check_invariants(scheduler)
    stats = scheduler.stats()  # what the lora_requests_info metric shows
    assert (stats.running_loras, stats.waiting_loras) == (["a1"], ["a1", "a2"])


def test_adapters_never_share_kv_blocks_but_the_same_adapter_does() -> None:
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_loras=4)
    runner = FakeRunner(block_size=4)
    prompt = list(range(10, 30))
    scheduler.add_request(_request("first", 1, prompt, max_tokens=1))
    step(scheduler, runner)
    for req_id, lora_id in (("same", 1), ("other", 2), ("base", 0)):
        scheduler.add_request(_request(req_id, lora_id, prompt, max_tokens=1))
    out, _ = step(scheduler, runner)
    computed = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
    assert computed == {"same": 16, "other": 0, "base": 0}
