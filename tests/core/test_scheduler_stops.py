"""Stop checks in update_from_output: EOS, ignore_eos, min_tokens, stop ids, max_tokens, length."""

from core_fakes import FakeRunner, make_request, make_scheduler, step

from paphos.request import RequestStatus

EOS = 2


def scripted(tokens: list[int]) -> FakeRunner:
    """A runner that samples the given tokens in order (then 1s)."""
    it = iter(tokens)
    return FakeRunner(4, sample_fn=lambda _rid, _toks, _kv: next(it, 1))


def generate(script: list[int], max_model_len: int = 64, prompt=(5, 6, 7), eos=EOS, **params):
    s = make_scheduler(max_model_len=max_model_len)
    runner = scripted(script)
    req = make_request("r", list(prompt), eos_token_id=eos, **params)
    s.add_request(req)
    outputs = []
    for _ in range(200):
        if not s.has_unfinished_requests():
            break
        outputs += step(s, runner)[1]
    last = outputs[-1]
    assert last.finished and all(not o.finished for o in outputs[:-1])
    assert s.kv_usage == 0.0  # finished requests free their blocks at once
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert tokens == req.output_token_ids
    return tokens, last, req


def test_eos_stops_with_reason_none():
    tokens, last, req = generate([9, 9, EOS, 9])
    assert tokens == [9, 9, EOS] and last.finish_reason == "stop" and last.stop_reason is None
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_extra_eos_ids_stop_like_eos():
    tokens, last, _ = generate([9, 11, 9], extra_eos_token_ids=(11,))
    assert tokens == [9, 11] and last.finish_reason == "stop" and last.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    tokens, last, _ = generate([EOS, EOS, 11, EOS], ignore_eos=True, max_tokens=4, extra_eos_token_ids=(11,))
    assert tokens == [EOS, EOS, 11, EOS] and last.finish_reason == "length"


def test_min_tokens_defers_eos_and_stop_ids():
    # Tokens 1..min_tokens may not stop; token min_tokens + 1 may.
    tokens, last, _ = generate([EOS, 13, EOS], min_tokens=2, stop_token_ids=[13])
    assert tokens == [EOS, 13, EOS] and last.stop_reason is None
    tokens, last, _ = generate([EOS, 9, 13], min_tokens=2, stop_token_ids=[13])
    assert tokens == [EOS, 9, 13] and last.stop_reason == 13


def test_stop_token_id_sets_stop_reason():
    tokens, last, _ = generate([9, 13, 9], stop_token_ids=[13])
    assert tokens == [9, 13] and last.finish_reason == "stop" and last.stop_reason == 13


def test_eos_checked_before_stop_ids():
    _, last, _ = generate([EOS], stop_token_ids=[EOS])
    assert last.stop_reason is None


def test_stop_beats_length_on_the_same_token():
    _, last, _ = generate([9, EOS], max_tokens=2)
    assert last.finish_reason == "stop"


def test_max_tokens():
    tokens, last, req = generate([9] * 10, max_tokens=3)
    assert tokens == [9, 9, 9] and last.finish_reason == "length"
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_max_model_len_when_max_tokens_is_none():
    tokens, last, req = generate([9] * 100, max_model_len=12, max_tokens=None)
    assert len(tokens) == 9 and req.num_tokens == 12 and last.finish_reason == "length"


def test_no_eos_token_id():
    tokens, last, _ = generate([EOS, 9], eos=None, max_tokens=2)
    assert tokens == [EOS, 9] and last.finish_reason == "length"


def test_logprobs_are_copied_for_the_accepted_tokens():
    s = make_scheduler()
    runner = FakeRunner(4)
    s.add_request(make_request("r", [1, 2, 3], logprobs=2, max_tokens=1))
    out = s.schedule()
    result = runner.execute(out)
    result.logprobs["r"] = ["lp"]
    (o,) = s.update_from_output(out, result)
    assert o.new_logprobs == ["lp"] and o.new_sampled_logprobs == [-0.5] and o.finish_reason == "length"
