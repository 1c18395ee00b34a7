"""End to end: `python -m paphos run` with the bundled default model, driven by the official openai client.

One server process for the module (loading takes a while on CPU). Checks what a real client sees:
the shapes the `openai` package parses, streaming, errors as typed exceptions, and that a client
walking away mid-stream does not hurt the next request.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.server.spawn import NAME


@pytest.fixture(scope="module")
def server(spawned_server: str) -> str:
    return spawned_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [NAME, "other-name"]


def test_completion_greedy_is_deterministic(client):
    kwargs = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert first.choices[0].text and first.choices[0].text == second.choices[0].text
    assert first.model == NAME and first.id.startswith("cmpl-")
    assert first.usage.completion_tokens == 6 and first.choices[0].finish_reason == "length"
    assert first.usage.total_tokens == first.usage.prompt_tokens + 6


def test_completion_logprobs(client):
    out = client.completions.create(model="other-name", prompt="1, 2, 3,", max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert token in top and len(top) <= 3


def test_completion_stream_n2(client):
    stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=5, n=2,
                                       stream=True, stream_options={"include_usage": True})
    texts = {0: "", 1: ""}
    finished = set()
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
        assert len(chunk.choices) <= 1
    assert finished == {0, 1} and all(texts.values())
    assert usage is not None and usage.completion_tokens == 10


def test_chat(client):
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Say hello."}],
                                         max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert len(choice.logprobs.content) == out.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 for item in choice.logprobs.content)


def test_chat_stream(client):
    messages = [{"role": "user", "content": "Count to five."}]
    # Both compared requests then reuse the same cached prompt blocks, so they run the same
    # arithmetic; a cold and a cached prefill may round differently and flip a near-tie.
    client.chat.completions.create(model=NAME, messages=messages, max_tokens=1, temperature=0)
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Count to five."}],
                                            max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    greedy = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Count to five."}],
                                            max_tokens=8, temperature=0)
    assert text == greedy.choices[0].message.content


def test_errors_are_typed(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert "The model `nope` does not exist." in str(exc.value)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=NAME, prompt="hi", max_tokens=5000)
    assert "maximum context length is 2048 tokens" in str(exc.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[], max_tokens=1)
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=1).choices


def test_abandoned_stream_does_not_hurt_the_next_request(client, server):
    stream = client.completions.create(model=NAME, prompt="Write a long story:", max_tokens=1500,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    start = time.monotonic()
    out = client.completions.create(model=NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert time.monotonic() - start < 60
    assert httpx.get(f"{server}/health").status_code == 200


def test_tokenize_roundtrip(server):
    tokens = httpx.post(f"{server}/v1/tokenize", json={"model": NAME, "prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    text = httpx.post(f"{server}/v1/detokenize", json={"model": NAME, "tokens": tokens["tokens"]}).json()
    assert text["prompt"].endswith("Hello world")


def test_engine_core_step_trace_shows_the_request(client, spawned_server_dir):
    """PAPHOS_STEP_TRACE (set by the spawned_server fixture): one JSON line per core step, and a
    request's steps are there: one that scheduled it, then one per generated token."""
    trace = spawned_server_dir / "step_trace.jsonl"
    before = len(trace.read_text().splitlines())
    client.completions.create(model=NAME, prompt="Count: 1, 2,", max_tokens=5, temperature=0)
    steps = [json.loads(line) for line in trace.read_text().splitlines()[before:]]
    assert {"t", "ms", "inputs", "sampled", "new", "running", "waiting"} <= set(steps[0])
    assert sum(s["new"] for s in steps) >= 1 and sum(s["sampled"] for s in steps) >= 5
    assert all(s["ms"] > 0 for s in steps) and [s["t"] for s in steps] == sorted(s["t"] for s in steps)


def test_the_sequences_of_one_request_start_in_the_same_step(client, spawned_server_dir):
    """n = 2: both sequences reach the engine core in one message, so they are scheduled in one
    step and stream in lockstep (one delivery per step, not two)."""
    trace = spawned_server_dir / "step_trace.jsonl"
    before = len(trace.read_text().splitlines())
    out = client.completions.create(model=NAME, prompt="Colors: red,", max_tokens=3, temperature=0.8, n=2)
    assert [c.finish_reason for c in out.choices] == ["length", "length"]
    steps = [json.loads(line) for line in trace.read_text().splitlines()[before:]]
    assert [s["new"] for s in steps if s["new"]] == [2]
