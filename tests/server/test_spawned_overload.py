"""Overload and deadlines, as a client sees them: past `--max-num-waiting` requests that have not
started yet, a new request is answered 429 in the OpenAI error shape with Retry-After at once,
instead of joining a queue that grows without bound, and a queued request whose client goes away
makes room again; past `--request-timeout` a request is aborted with a 504."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx

from tests.server.spawn import NAME, spawn_server_process

LONG = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


async def _wait_for(client: httpx.AsyncClient, gauge: str, count: int) -> None:
    """Until the server's `aphrodite:num_requests_{gauge}` gauge reads `count`."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        match = re.search(rf"^aphrodite:num_requests_{gauge}\S* (\S+)$", text, re.MULTILINE)
        if match and float(match.group(1)) == count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine never had {count} requests {gauge}")


async def _scenario(base: str) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        running = asyncio.create_task(client.post("/v1/completions", json=LONG))
        await _wait_for(client, "running", 1)
        queued = [asyncio.create_task(client.post("/v1/completions", json=LONG)) for _ in range(2)]
        await _wait_for(client, "waiting", 2)

        refused = await client.post("/v1/completions", json={**LONG, "max_tokens": 4})
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == 429 and error["type"] == "RateLimitError"
        assert "--max-num-waiting 2" in error["message"]
        kobold = await client.post("/api/v1/generate", json={"prompt": "Hi", "max_length": 4})
        assert kobold.status_code == 429 and "msg" in kobold.json()["detail"]

        for task in queued:  # the queued clients give up: their places are freed
            task.cancel()
        await _wait_for(client, "waiting", 0)
        admitted = asyncio.create_task(client.post("/v1/completions", json={**LONG, "max_tokens": 2}))
        await _wait_for(client, "waiting", 1)
        running.cancel()
        response = await admitted
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_full_admission_queue_answers_429_and_frees_when_queued_requests_leave(tmp_path: Path) -> None:
    with spawn_server_process(tmp_path, "--max-num-seqs", "1", "--max-num-waiting", "2") as (_, base):
        asyncio.run(_scenario(base))


def test_request_timeout_aborts_a_long_request_with_504_or_an_error_event(tmp_path: Path) -> None:
    """--request-timeout: a request still running past it is aborted (its slot and KV blocks
    freed): 504 before its first token, an error event with code 504 once it streams."""
    with (
        spawn_server_process(tmp_path, "--request-timeout", "4") as (_, base),
        httpx.Client(base_url=base, timeout=60) as client,
    ):
        assert client.post("/v1/completions", json={**LONG, "max_tokens": 1}).status_code == 200
        started = time.monotonic()
        late = client.post("/v1/completions", json=LONG)
        assert late.status_code == 504 and late.json()["error"]["type"] == "TimeoutError"
        assert 4 <= time.monotonic() - started < 10
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert len(events) > 2 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == 504
        asyncio.run(_wait_for(httpx.AsyncClient(base_url=base), "running", 0))
