"""A real server under bad input and abandoned streams: every bad request gets a 4xx in the
OpenAI error shape, the next request is still served, and disconnected clients give their KV
blocks back."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from tests.server.spawn import NAME

GOOD = {"model": NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0}


def used_blocks(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(r"^paphos:kv_cache_used_blocks\{[^}]*\} (\S+)$", text, re.MULTILINE)
    assert match, text
    return float(match.group(1))


BAD_COMPLETIONS = [
    ({"prompt": "x", "model": NAME, "temperature": "hot"}, 400, "temperature"),
    ({"model": NAME}, 400, "prompt"),
    ({"prompt": "x", "model": "nope"}, 404, "model"),
    ({"prompt": "x", "model": NAME, "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "model": NAME, "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "model": NAME, "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "model": NAME, "top_k": -2}, 400, "top_k"),
    ({"prompt": "x", "model": NAME, "min_p": 1.5}, 400, "min_p"),
    ({"prompt": "x", "model": NAME, "n": 0}, 400, "n"),
    ({"prompt": "x", "model": NAME, "n": 100000}, 400, "n"),
    ({"prompt": "x", "model": NAME, "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "model": NAME, "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": "x", "model": NAME, "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "x", "model": NAME, "stop": [""]}, 400, "stop"),
    ({"prompt": [1, 2, 999999], "model": NAME}, 400, "prompt"),
    ({"prompt": "x", "model": NAME, "suffix": "y"}, 400, "suffix"),
]
BAD_CHAT = [
    ({"model": NAME}, 400, "messages"),
    ({"model": NAME, "messages": []}, 400, "messages"),
    ({"model": NAME, "messages": "hi"}, 400, "messages"),
]


def assert_error_shape(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error" and body["code"] == status
    assert body["error"]["message"] == body["message"] and body["message"]
    if param is not None:
        assert body["param"] == param, body


@pytest.mark.parametrize(("route", "body", "status", "param"),
                         [("/v1/completions", *c) for c in BAD_COMPLETIONS] + [("/v1/chat/completions", *c) for c in BAD_CHAT])
def test_bad_request_is_a_4xx_and_the_next_request_is_served(spawned_server: str, route, body, status, param) -> None:
    assert_error_shape(httpx.post(f"{spawned_server}{route}", json=body, timeout=60), status, param)
    ok = httpx.post(f"{spawned_server}/v1/completions", json=GOOD, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_malformed_json_and_huge_prompt(spawned_server: str) -> None:
    r = httpx.post(f"{spawned_server}/v1/completions", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})
    assert_error_shape(r, 400, None)
    started = time.monotonic()
    r = httpx.post(f"{spawned_server}/v1/completions", json={**GOOD, "prompt": "word " * 2_000_000}, timeout=120)
    assert_error_shape(r, 400, "prompt")
    assert time.monotonic() - started < 30
    assert httpx.post(f"{spawned_server}/v1/completions", json=GOOD, timeout=60).status_code == 200


async def _stream(client: httpx.AsyncClient, base: str, index: int, disconnect: bool) -> int | None:
    body = {**GOOD, "prompt": f"Story number {index}: once upon a time", "max_tokens": 24,
            "temperature": 0.8, "seed": index, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = 0
    completion_tokens = None
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            assert "error" not in payload, payload
            if payload.get("usage"):
                completion_tokens = payload["usage"]["completion_tokens"]
            chunks += 1
            if disconnect and chunks == 3:
                return None  # leaving the context manager closes the connection mid-stream
        return completion_tokens


def test_half_of_32_streams_disconnect_the_rest_finish_and_blocks_return(spawned_server: str) -> None:
    async def run() -> list[int | None]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(_stream(client, spawned_server, i, i % 2 == 0) for i in range(32)))

    results = asyncio.run(run())
    finished = [r for i, r in enumerate(results) if i % 2 == 1]
    # ignore_eos: every surviving stream runs to exactly max_tokens.
    assert finished == [24] * 16, finished
    deadline = time.monotonic() + 30
    while used_blocks(spawned_server) != 0:
        assert time.monotonic() < deadline, "KV blocks of the disconnected requests were not freed"
        time.sleep(0.2)
