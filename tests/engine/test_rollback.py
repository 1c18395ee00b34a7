"""Phrase-ban rollback in the scheduler (Scheduler.rollback_request): the runner is told through
ordinary diffs, KV blocks past the kept prefix are given back, the partial block is recomputed,
and the ban reaches the runner in its new-request data. The fake runner checks the KV of every
position."""

from __future__ import annotations

from tests.core.core_fakes import FakeRunner, check_invariants, make_request, make_scheduler, step


def test_rollback_truncates_recomputes_and_bans_at_that_position() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=12))
    scheduler.add_request(make_request("b", [1, 2, 3, 4, 5], max_tokens=12))
    for _ in range(7):
        step(scheduler, runner)
    req = scheduler.requests["a"]
    assert req.num_output_tokens == 7
    banned = req.output_token_ids[3]
    scheduler.rollback_request("a", 3, banned)
    check_invariants(scheduler)
    assert req.num_output_tokens == 3 and req.num_tokens == 8
    assert req.num_computed_tokens == 4  # the block holding the last kept token is recomputed
    assert req.position_bans == {3: [banned]}
    out, _ = step(scheduler, runner)
    assert "a" in out.preempted_req_ids and [n.req_id for n in out.scheduled_new_reqs] == ["a"]
    assert out.num_scheduled_tokens["a"] == 4
    assert runner.reqs["a"].tokens[:8] == req.all_token_ids[:8]
    # A second rollback further back drops the later position's bans and keeps accumulating.
    scheduler.rollback_request("a", 2, 77)
    assert req.position_bans == {2: [77]}
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, runner)
    assert not scheduler.has_unfinished_requests()


def test_rollback_of_unknown_or_finished_requests_is_ignored() -> None:
    scheduler = make_scheduler()
    scheduler.rollback_request("nope", 0, 1)
    runner = FakeRunner(4)
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=2))
    for _ in range(3):
        step(scheduler, runner)
    scheduler.rollback_request("a", 0, 1)
    check_invariants(scheduler)


def _finish_phrase_ban_request(scheduler, runner) -> None:
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=6, banned_strings=["x"]))
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)


def test_a_phrase_ban_request_finished_at_max_tokens_can_still_be_rolled_back() -> None:
    """Its last token may complete a banned phrase the API side has not seen yet: the core keeps
    it (without blocks) until that side confirms, and a rollback makes it run again."""
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(4)
    _finish_phrase_ban_request(scheduler, runner)
    out, _ = step(scheduler, runner)
    assert "a" in out.preempted_req_ids and "a" not in out.finished_req_ids  # sampling state kept
    assert scheduler.num_used_blocks == 0
    assert scheduler.rollback_request("a", 5, 11)
    req = scheduler.requests["a"]
    assert req.num_output_tokens == 5 and req.position_bans == {5: [11]}
    tokens = []
    while scheduler.has_unfinished_requests():
        tokens += [t for o in step(scheduler, runner)[1] for t in o.new_token_ids]
    assert len(tokens) == 1 and req.num_output_tokens == 6  # resumed to max_tokens
    scheduler.finish_requests(["a"], req.status)  # the API side confirms the second finish
    assert not scheduler._held
    out, _ = step(scheduler, runner)
    assert "a" in out.finished_req_ids
    check_invariants(scheduler)


def test_a_confirmed_finish_releases_the_held_request() -> None:
    scheduler = make_scheduler(block_size=4)
    runner = FakeRunner(4)
    _finish_phrase_ban_request(scheduler, runner)
    scheduler.finish_requests(["a"], scheduler._held["a"].status)
    assert not scheduler._held and not scheduler.rollback_request("a", 0, 1)
    assert not scheduler.has_unfinished_requests()
    assert "a" in scheduler.schedule().finished_req_ids
