"""/v1/completions: response shape, several prompts and n, echo, logprobs, SSE streaming."""

from __future__ import annotations

import json

from tests.server.fakes import sse_events

FORBIDDEN_CHUNK_KEYS = {"message", "error", "detail"}


def _stream(client, body):
    response = client.post("/v1/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_events(response.text)
    assert payloads[-1] == "[DONE]"
    for raw in payloads[:-1]:
        # Compact JSON: exactly what json.dumps with tight separators writes.
        assert raw == json.dumps(json.loads(raw), separators=(",", ":"), ensure_ascii=False)
    return [json.loads(p) for p in payloads[:-1]]


def test_basic_response_shape(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-") and len(body["id"]) == 5 + 32
    assert body["object"] == "text_completion" and isinstance(body["created"], int)
    assert body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "text": "abcd", "logprobs": None, "finish_reason": "length",
                                "stop_reason": None, "prompt_logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_model_optional_and_aliases(client):
    for model in (None, "fake-model", "alias"):
        body = {"prompt": "hi", "max_tokens": 1} | ({"model": model} if model else {})
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "fake-model"


def test_several_prompts_and_n(client, engine):
    r = client.post("/v1/completions", json={"prompt": ["hi", "yo!"], "max_tokens": 2, "n": 2})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["ab", "bc", "ab", "bc"]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}
    request_ids = sorted(call[0] for call in engine.calls[-2:])
    assert request_ids[0].endswith("-0") and request_ids[1].endswith("-1")
    r = client.post("/v1/completions", json={"prompt": [[5, 6, 7], [8]], "max_tokens": 1})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert sorted(call[1] for call in engine.calls[-2:]) == [[5, 6, 7], [8]]


def test_echo(client, engine):
    body = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": True}).json()
    assert body["choices"][0]["text"] == "hiab"
    calls = len(engine.calls)
    body = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0, "echo": True}).json()
    assert body["choices"][0]["text"] == "hi" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert len(engine.calls) == calls + 1 and engine.calls[-1][2].max_tokens == 1


def test_logprobs_shape(client):
    body = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "logprobs": 3}).json()
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert lp["tokens"] == ["a", "b", "c", "d"]
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert lp["token_logprobs"] == [-0.75, -0.5, -0.75, -0.5]
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        assert isinstance(top, dict) and token in top and len(top) <= 4
    # -inf is written as -9999.0 (and the JSON parses: no Infinity literal).
    assert any(-9999.0 in top.values() for top in lp["top_logprobs"])


def test_logprobs_sampled_token_outside_top_n(client):
    lp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 1}).json()["choices"][0]["logprobs"]
    # Step 0: the sampled token is rank 2, so the dict holds the top-1 plus it.
    assert lp["top_logprobs"][0] == {"b": -0.5, "a": -0.75}
    assert lp["top_logprobs"][1] == {"b": -0.5}
    lp0 = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert lp0["top_logprobs"] == [{"a": -0.75}]


def test_echo_logprobs(client, engine):
    body = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 1, "echo": True}).json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "hiab"
    assert lp["tokens"] == ["<s>", "h", "i", "a", "b"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # BOS is not part of the text: h starts at 0; generated tokens continue after the prompt.
    assert lp["text_offset"] == [0, 0, 1, 2, 3]
    assert engine.calls[-1][2].prompt_logprobs == 1


def test_prompt_logprobs_field(client):
    choice = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "prompt_logprobs": 2}).json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 3
    assert plp[1][str(ord("h"))] == {"logprob": -1.0, "rank": 3, "decoded_token": "h"}
    assert plp[1][str(ord("x"))]["rank"] == 1


def test_return_tokens_as_token_ids(engine):
    from starlette.testclient import TestClient

    from tests.server.fakes import make_app

    with TestClient(make_app(engine, return_tokens_as_token_ids=True)) as c:
        while not engine.is_ready:
            pass
        lp = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 1}).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["token_id:97", "token_id:98"]
    assert lp["top_logprobs"][0] == {"token_id:98": -0.5, "token_id:97": -0.75}
    assert lp["text_offset"] == [0, 1]


def test_stream_framing_and_chunks(client):
    chunks = _stream(client, {"prompt": "hi", "max_tokens": 3})
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc"
    for chunk in chunks:
        assert not FORBIDDEN_CHUNK_KEYS & set(chunk)
        assert chunk["object"] == "text_completion" and chunk["usage"] is None
        assert len(chunk["choices"]) == 1
        assert set(chunk["choices"][0]) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


def test_stream_n2_one_choice_per_chunk(client):
    chunks = _stream(client, {"prompt": ["hi", "yo"], "max_tokens": 2, "n": 2})
    assert all(len(c["choices"]) == 1 for c in chunks)
    texts: dict[int, str] = {}
    finished = set()
    for chunk in chunks:
        choice = chunk["choices"][0]
        assert choice["index"] not in finished
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finished.add(choice["index"])
    assert texts == {0: "ab", 1: "bc", 2: "ab", 3: "bc"} and finished == {0, 1, 2, 3}


def test_stream_usage(client):
    chunks = _stream(client, {"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert all(c["usage"] is None for c in chunks[:-1])
    chunks = _stream(client, {"prompt": "hi", "max_tokens": 2, "stream_options": {"continuous_usage_stats": True}})
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2]
    assert chunks[-1]["choices"]  # no extra usage chunk without include_usage


def test_stream_logprobs_and_echo(client):
    chunks = _stream(client, {"prompt": "hi", "max_tokens": 2, "logprobs": 1, "echo": True})
    first = chunks[0]["choices"][0]
    assert first["text"] == "hia"
    assert first["logprobs"]["tokens"] == ["<s>", "h", "i", "a"]
    second = chunks[1]["choices"][0]
    assert second["logprobs"]["tokens"] == ["b"] and second["logprobs"]["text_offset"] == [3]


def test_stream_error_after_start(client):
    response = client.post("/v1/completions", json={"prompt": "RAISE", "max_tokens": 5, "stream": True})
    assert response.status_code == 200
    payloads = sse_events(response.text)
    error = json.loads(payloads[-2])
    assert error["object"] == "error" and error["error"]["code"] == 500 and error["code"] == 500
    assert "boom" in error["message"]
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_stream_error_before_start_is_plain_http_error(client):
    response = client.post("/v1/completions", json={"prompt": "KVFULL", "max_tokens": 5, "stream": True})
    assert response.status_code == 400 and response.json()["param"] == "prompt"
