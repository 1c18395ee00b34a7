"""Client disconnects abort the engine request (streaming or not), driven through raw ASGI calls."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.server.fakes import FakeEngine, make_app


async def _call(app, path: str, body: bytes, disconnect_after: float | None, chunked: bool = False):
    messages: list[dict] = []
    gone = asyncio.Event()
    pending = [body[i:i + 1 << 20] for i in range(0, len(body), 1 << 20)] if chunked else [body]

    async def receive():
        if pending:
            part = pending.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(pending)}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        messages.append(message)

    headers = [(b"content-type", b"application/json")]
    if not chunked:
        headers.append((b"content-length", str(len(body)).encode()))
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 2242),
    }
    task = asyncio.create_task(app(scope, receive, send))
    if disconnect_after is not None:
        await asyncio.sleep(disconnect_after)
        gone.set()
    await asyncio.wait_for(task, 5)
    return messages


def _ready_app():
    engine = FakeEngine()
    engine.is_ready = True  # no lifespan in raw calls
    return engine, make_app(engine)


def _body_chunks(messages):
    return [m.get("body", b"") for m in messages if m["type"] == "http.response.body" and m.get("body")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("delay", [0.005, 0.15])
def test_streaming_disconnect_aborts(path, delay):
    engine, app = _ready_app()
    payload = {"max_tokens": 200, "stream": True}
    payload |= {"prompt": "SLOW"} if "chat" not in path else {"messages": [{"role": "user", "content": "SLOW"}]}
    messages = asyncio.run(_call(app, path, json.dumps(payload).encode(), delay))
    assert len(engine.aborted) == 1 and not engine.completed
    chunks = _body_chunks(messages)
    assert b"[DONE]" not in b"".join(chunks)
    if delay > 0.1:
        assert chunks  # it had started streaming


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_streaming_disconnect_aborts(path):
    engine, app = _ready_app()
    payload = {"max_tokens": 200}
    payload |= {"prompt": "SLOW"} if "chat" not in path else {"messages": [{"role": "user", "content": "SLOW"}]}
    asyncio.run(_call(app, path, json.dumps(payload).encode(), 0.1))
    assert len(engine.aborted) == 1 and not engine.completed


def test_several_prompts_all_aborted():
    engine, app = _ready_app()
    payload = {"prompt": ["SLOW 1", "SLOW 2"], "n": 2, "max_tokens": 200, "stream": True}
    asyncio.run(_call(app, "/v1/completions", json.dumps(payload).encode(), 0.1))
    assert len(engine.aborted) == 2


def test_finished_request_is_not_aborted():
    engine, app = _ready_app()
    payload = {"prompt": "hi", "max_tokens": 3, "stream": True}
    messages = asyncio.run(_call(app, "/v1/completions", json.dumps(payload).encode(), None))
    assert engine.completed and not engine.aborted
    assert b"".join(_body_chunks(messages)).endswith(b"data: [DONE]\n\n")


def test_chunked_oversized_body_413():
    _, app = _ready_app()
    body = b'{"prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    messages = asyncio.run(_call(app, "/v1/completions", body, None, chunked=True))
    start = next(m for m in messages if m["type"] == "http.response.start")
    assert start["status"] == 413
    error = json.loads(b"".join(_body_chunks(messages)))
    assert error["object"] == "error" and error["code"] == 413


@pytest.mark.parametrize("path", ["/api/v1/generate", "/api/extra/generate/stream"])
def test_kobold_disconnect_aborts_and_ends_the_job(path):
    engine, app = _ready_app()
    body = json.dumps({"prompt": "SLOW", "max_length": 200, "genkey": "GONE"}).encode()
    asyncio.run(_call(app, path, body, 0.15))
    assert len(engine.aborted) == 1 and not engine.completed
    job = app.state.kobold_jobs.get("GONE")
    assert not job.running and job.finish_reason == "abort" and 0 < job.completion_tokens < 200
