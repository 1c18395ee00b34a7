"""/v1/chat/completions: template controls, defaults, logprobs, streaming."""

from __future__ import annotations

import json

from tests.server.fakes import sse_events

USER = [{"role": "user", "content": "hi"}]


def _chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": USER, **body})


def test_basic_response(client, engine):
    body = _chat(client, max_tokens=3).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "abc", "tool_calls": []}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None and choice["index"] == 0
    prompt = engine.tokenizer.decode(engine.calls[-1][1])
    assert prompt == "<user>hi\n<assistant>"
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 3, "total_tokens": len(prompt) + 3}
    # No BOS by default on chat (the template owns special tokens).
    assert engine.calls[-1][1][0] != 1


def test_default_max_tokens_is_rest_of_context(client, engine):
    assert _chat(client).status_code == 200
    _, ids, params = engine.calls[-1]
    assert params.max_tokens == engine.max_model_len - len(ids)
    assert params.temperature == 1.0
    assert _chat(client, max_completion_tokens=2, max_tokens=5).json()["usage"]["completion_tokens"] == 2


def test_template_controls(client, engine):
    messages = [*USER, {"role": "assistant", "content": "Sure"}]
    r = client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 1, "add_generation_prompt": False, "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False}, "chat_template": "{{T}}:",
    })
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(engine.calls[-1][1])
    assert prompt == "{{T}}:[enable_thinking=False]<user>hi\n<assistant>Sure"


def test_content_parts_and_echo(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "Once"}]
    body = client.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 2, "echo": True, "add_generation_prompt": False,
        "continue_final_message": True,
    }).json()
    assert body["choices"][0]["message"]["content"] == "Onceab"


def test_logprobs_shape(client):
    choice = _chat(client, max_tokens=2, logprobs=True, top_logprobs=2).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 2
    first = content[0]
    assert first == {"token": "a", "logprob": -0.75, "bytes": [97],
                     "top_logprobs": [{"token": "b", "logprob": -0.5, "bytes": [98]},
                                      {"token": "a", "logprob": -0.75, "bytes": [97]}]}
    no_top = _chat(client, max_tokens=1, logprobs=True).json()["choices"][0]["logprobs"]["content"]
    assert no_top[0]["top_logprobs"] == []


def test_stream_roles_and_finish(client):
    r = _chat(client, max_tokens=2, n=2, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200
    payloads = sse_events(r.text)
    chunks = [json.loads(p) for p in payloads[:-1]]
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk" and len(chunk["choices"]) == 1
        assert not {"message", "error", "detail"} & set(chunk)
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for chunk in chunks:
        by_index[chunk["choices"][0]["index"]].append(chunk["choices"][0])
    for index, choices in by_index.items():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in choices) == ("ab" if index == 0 else "bc")
        assert choices[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in choices[:-1])


def test_stream_error_chunk(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "ERRFIELD"}], "max_tokens": 5, "stream": True})
    payloads = sse_events(r.text)
    error = json.loads(payloads[-2])
    assert error["object"] == "error" and error["error"]["message"] == "sampler exploded"


def test_prompt_logprobs(client):
    body = _chat(client, max_tokens=1, prompt_logprobs=1).json()
    assert body["prompt_logprobs"][0] is None
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
