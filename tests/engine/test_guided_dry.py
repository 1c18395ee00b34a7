"""Guided decoding and DRY on the bundled default model (SmolLM2-135M, CPU).

Guided: sampled JSON-schema completions all validate; regex and choice outputs always match.
DRY: on a repetitive prompt, greedy continuation repeats the prompt's 4-grams far less with DRY.
"""

from __future__ import annotations

import json
import re

import pytest
import xgrammar
from pydantic import BaseModel, ConfigDict, Field

from paphos.llm import LLM
from paphos.sampling_params import ParamError, SamplingParams


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512)


def generate(llm: LLM, prompt: str, count: int, **kwargs) -> list[str]:
    max_tokens = kwargs.pop("max_tokens", 48)
    params = [SamplingParams(max_tokens=max_tokens, seed=i, **kwargs) for i in range(count)]
    return [o.outputs[0].text for o in llm.generate([prompt] * count, params)]


def test_json_schema_completions_all_validate(llm: LLM) -> None:
    texts = generate(llm, "Describe a person as JSON:", 50, guided_json=SCHEMA, temperature=1.0)
    for text in texts:
        Person.model_validate_json(text)
    json_objects = generate(llm, "A JSON object:", 5, response_format={"type": "json_object"}, max_tokens=64)
    assert sum(isinstance(json.loads(t), dict) for t in json_objects if t.rstrip().endswith("}")) >= 1


def test_regex_and_choice_always_match(llm: LLM) -> None:
    pattern = r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}"
    for text in generate(llm, "Write a fact:", 20, guided_regex=pattern, temperature=1.2):
        assert re.fullmatch(pattern, text), text
    choices = ["yes", "no", "maybe so"]
    texts = generate(llm, "Is the sky blue?", 20, guided_choice=choices, temperature=1.5)
    assert set(texts) <= set(choices) and len(set(texts)) > 1


def test_grammar_gbnf_and_bad_grammar(llm: LLM) -> None:
    grammar = 'root ::= "(" [a-c]+ ")"'
    for text in generate(llm, "Letters:", 5, guided_grammar=grammar, temperature=1.0, max_tokens=16):
        assert re.fullmatch(r"\([a-c]+\)", text) or (text.startswith("(") and set(text[1:]) <= set("abc")), text
    with pytest.raises(ParamError) as info:
        llm.generate(["x"], SamplingParams(guided_regex="(unclosed"))
    assert info.value.param == "guided_regex"


def repeated_4grams(tokens: list[int], context: list[int]) -> int:
    seen = {tuple(context[i:i + 4]) for i in range(len(context) - 3)}
    count = 0
    for i in range(len(tokens) - 3):
        gram = tuple(tokens[i:i + 4])
        count += gram in seen
        seen.add(gram)
    return count


def test_dry_reduces_verbatim_repetition(llm: LLM) -> None:
    prompt = "The cat sat on the mat. The dog sat on the log. " * 4 + "The cat"
    context = llm.tokenizer.encode(prompt)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    dry = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, dry_multiplier=1.0,
                                                dry_allowed_length=2))[0].outputs[0]
    plain_repeats = repeated_4grams(plain.token_ids, context)
    dry_repeats = repeated_4grams(dry.token_ids, context)
    assert plain_repeats >= 20
    assert dry_repeats <= plain_repeats // 2, (plain.text, dry.text)


def test_guided_choice_composes_with_banned_strings(llm: LLM) -> None:
    # Banning a choice rolls the grammar matcher back with the tokens: only the other choice is left.
    texts = generate(llm, "Is the sky blue?", 8, guided_choice=["yes", "no"], banned_strings=["yes"],
                     temperature=1.5)
    assert set(texts) == {"no"}


def test_a_failing_grammar_matcher_ends_only_its_own_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar matcher that raises mid-generation ends that request with an error and frees its
    KV blocks; the request beside it in the same batch runs to its end, token for token as alone."""
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], plain)[0].outputs[0].token_ids
    accept = xgrammar.GrammarMatcher.accept_token
    calls = 0

    def breaks_on_the_third_token(self, token_id, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("matcher broke")
        return accept(self, token_id, *args, **kwargs)

    monkeypatch.setattr(xgrammar.GrammarMatcher, "accept_token", breaks_on_the_third_token)
    guided = SamplingParams(max_tokens=16, temperature=0, guided_json=SCHEMA)
    failed, survivor = llm.generate(["Describe a person as JSON:", "Once upon a time"], [guided, plain])
    assert failed.error is not None and "matcher broke" in failed.error
    assert failed.outputs[0].finish_reason == "abort" and len(failed.outputs[0].token_ids) == 2
    assert survivor.error is None and survivor.outputs[0].token_ids == alone
    kv = llm.engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks
