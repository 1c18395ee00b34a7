"""Banned phrases end to end on a tiny model (contract §4.4.12): a phrase that sampled completions
often contain never appears once banned, the streamed deltas never retract text (the merged
deltas are exactly the decoded streamed tokens)."""

from __future__ import annotations

from collections import Counter

import pytest

from paphos.core.protocol import RollbackRequest
from paphos.llm import LLM
from paphos.outputs import RequestOutput, accumulate
from paphos.sampling_params import SamplingParams

NUM = 200


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    from tests.engine.conftest import _build

    path, _ = _build(tmp_path_factory.mktemp("phrase"), "llama")
    return LLM(str(path), dtype="float32", max_model_len=128, block_size=4)


def sample(llm: LLM, **kwargs) -> list:
    params = [SamplingParams(temperature=0.7, max_tokens=8, seed=i, ignore_eos=True, **kwargs) for i in range(NUM)]
    return [o.outputs[0] for o in llm.generate(["w5 w6 w7"] * NUM, params)]


@pytest.fixture(scope="module")
def plain(llm: LLM) -> list:
    return sample(llm)


def test_banned_phrases_never_appear_in_200_completions(llm: LLM, plain: list) -> None:
    bigrams = Counter(b for o in plain for b in {" ".join(p) for p in zip(o.text.split(), o.text.split()[1:], strict=False)})
    phrase, count = bigrams.most_common(1)[0]
    assert count >= 20, "the phrase must be common without the ban for the test to mean anything"
    banned = sample(llm, banned_strings=[phrase.upper()])  # case-insensitive by default
    for out in banned:
        assert phrase not in out.text
        # What was streamed is exactly the streamed tokens' text: nothing was sent and retracted.
        assert out.text.strip() == llm.tokenizer.decode(out.token_ids).strip()
        # A phrase completed by the very last token (max_tokens) is regenerated, not cut off.
        assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_case_sensitive_ban_only_matches_exact_case(llm: LLM, plain: list) -> None:
    word = Counter(w for o in plain for w in o.text.split()).most_common(1)[0][0]
    kept = sample(llm, banned_strings=[word.upper()], banned_strings_case_sensitive=True)
    assert [o.token_ids for o in kept] == [o.token_ids for o in plain]
    gone = sample(llm, banned_strings=[word])
    assert all(word not in o.text.split() for o in gone)


def test_bans_hold_when_the_core_runs_ahead_of_its_follow_ups(llm: LLM, plain: list) -> None:
    """The server's core does not wait for the API process: a rollback reaches it a step (or more)
    after the outputs that asked for it. Outputs produced meanwhile are stale and dropped."""
    bigrams = Counter(b for o in plain for b in {" ".join(p) for p in zip(o.text.split(), o.text.split()[1:], strict=False)})
    phrase = bigrams.most_common(1)[0][0]
    engine = llm.engine
    ids = [f"late-{i}" for i in range(NUM)]
    prompt = llm.tokenizer.encode("w5 w6 w7")
    for i, request_id in enumerate(ids):
        params = SamplingParams(temperature=0.7, max_tokens=8, seed=i, ignore_eos=True, banned_strings=[phrase])
        engine.add_request(request_id, prompt, params)
    results: dict[str, RequestOutput | None] = dict.fromkeys(ids)
    late: list = []
    rollbacks = 0
    while engine.has_unfinished_requests() or late:
        outputs, followups = engine.frontend.process(engine.core.step())
        for message in late:  # one step late: the core already ran the next step
            engine.core.handle(message)
        late = followups
        rollbacks += sum(isinstance(m, RollbackRequest) for m in followups)
        for delta in outputs:
            results[delta.request_id] = accumulate(results[delta.request_id], delta)
    assert rollbacks >= 20, "the phrase must be common for the test to mean anything"
    for result in results.values():
        out = result.outputs[0]
        assert phrase not in out.text
        assert out.text.strip() == llm.tokenizer.decode(out.token_ids).strip()
        assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert not engine.scheduler._held and not engine.scheduler.requests
