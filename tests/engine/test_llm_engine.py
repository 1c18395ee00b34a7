"""LLMEngine behaviour a user of `paphos.LLM` notices: stops, n/best_of, seeds, logprobs, abort."""

from __future__ import annotations

import pytest

from paphos.engine.llm_engine import LLMEngine
from paphos.llm import LLM, build_engine_config
from paphos.sampling_params import ParamError, SamplingParams


@pytest.fixture
def llm(tiny_model) -> LLM:
    path, _ = tiny_model("llama")
    return LLM(str(path), dtype="float32", max_model_len=128, block_size=4)


def greedy_text(llm: LLM, prompt: str, **kwargs) -> str:
    out = llm.generate([prompt], SamplingParams(temperature=0, ignore_eos=True, **kwargs))[0]
    return out.outputs[0].text


def test_stop_string_truncates_and_reports_reason(llm: LLM) -> None:
    full = greedy_text(llm, "w5 w6 w7", max_tokens=10)
    words = full.split()
    stop = f"{words[2]} {words[3]}"
    out = llm.generate(["w5 w6 w7"], SamplingParams(temperature=0, max_tokens=10, stop=[stop], ignore_eos=True))[0]
    choice = out.outputs[0]
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    kept = llm.generate(["w5 w6 w7"], SamplingParams(
        temperature=0, max_tokens=10, stop=[stop], include_stop_str_in_output=True, ignore_eos=True))[0]
    assert kept.outputs[0].text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    tokens = llm.generate(["w9"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert tokens.finish_reason == "length" and len(tokens.token_ids) == 8
    stop_id = tokens.token_ids[3]
    first = tokens.token_ids.index(stop_id)
    out = llm.generate(["w9"], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id], ignore_eos=True))
    choice = out[0].outputs[0]
    assert choice.token_ids == tokens.token_ids[: first + 1]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop_id


def test_min_tokens_masks_stop_tokens(llm: LLM) -> None:
    first = llm.generate(["w9"], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    out = llm.generate(["w9"], SamplingParams(temperature=0, max_tokens=6, min_tokens=4, stop_token_ids=[first]))
    assert len(out[0].outputs[0].token_ids) >= 4
    assert first not in out[0].outputs[0].token_ids[:4]


def test_seeded_sampling_reproduces_and_n_gives_distinct_choices(llm: LLM) -> None:
    params = SamplingParams(temperature=1.5, max_tokens=12, seed=42, n=3, ignore_eos=True)
    a = llm.generate(["w3 w4"], params)[0]
    b = llm.generate(["w3 w4", "w8"], [params, SamplingParams(temperature=0.7, max_tokens=5)])[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_best_of_returns_the_n_most_likely(llm: LLM) -> None:
    out = llm.generate(["w3"], SamplingParams(temperature=1.0, max_tokens=6, n=2, best_of=5, seed=1, ignore_eos=True))[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob


def test_logprobs_cover_sampled_token_and_top_n(llm: LLM) -> None:
    out = llm.generate(["w3"], SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True))[0]
    choice = out.outputs[0]
    assert len(choice.logprobs) == 4
    for entry, token in zip(choice.logprobs, choice.token_ids, strict=True):
        assert entry.token_id == token and entry.rank == 1  # greedy takes the top token
        assert len(entry.top_token_ids) == 3 and entry.top_token_ids[0] == token
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)
    prompt = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    assert [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]


def test_validation_names_the_field(llm: LLM) -> None:
    with pytest.raises(ParamError) as err:
        llm.generate([[5] * 120], SamplingParams(max_tokens=20))
    assert err.value.param == "max_tokens" and "maximum context length is 128" in str(err.value)
    with pytest.raises(ParamError) as err:
        llm.generate([[5, 10_000]], SamplingParams())
    assert err.value.param == "prompt"
    with pytest.raises(ParamError):
        llm.generate(["w3"], SamplingParams(logprobs=21))


def test_abort_frees_every_block(tiny_model) -> None:
    path, _ = tiny_model("llama")
    engine = LLMEngine(build_engine_config(str(path), dtype="float32", max_model_len=128, block_size=4))
    for i in range(4):
        engine.add_request(str(i), [3 + i] * (10 + i), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.num_used_blocks > 0
    engine.abort_request(["0", "1", "2", "3"])
    engine.step()
    assert engine.scheduler.num_used_blocks == 0
    assert not engine.has_unfinished_requests()
