"""/health, /version, /v1/models, tokenize/detokenize."""

from __future__ import annotations

import time

from starlette.testclient import TestClient

from paphos.version import __version__
from tests.server.fakes import FakeEngine, assert_error_shape, make_app


def _wait(predicate, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_health_503_while_loading_then_200():
    engine = FakeEngine(ready_on_start=False)
    with TestClient(make_app(engine)) as client:
        # The HTTP server is up before the model: health and generation routes say 503, the model
        # list answers 200 (SillyTavern reads anything else as "offline").
        assert_error_shape(client.get("/health"), 503, "ServiceUnavailableError")
        assert_error_shape(client.post("/v1/completions", json={"prompt": "hi"}), 503)
        models = client.get("/v1/models")
        assert models.status_code == 200 and [c["id"] for c in models.json()["data"]] == ["fake-model", "alias"]
        assert client.get("/version").json() == {"version": __version__}
        engine.hold = False
        _wait(lambda: engine.is_ready)
        r = client.get("/health")
        assert r.status_code == 200 and r.content == b""
    assert engine.shut_down


def test_health_503_when_engine_fails_to_start():
    engine = FakeEngine()
    engine.fail_start = RuntimeError("no weights")
    failures = []
    from paphos.config import ServerConfig
    from paphos.server.app import build_app

    app = build_app(engine, ServerConfig(), ["m"], on_engine_failure=failures.append)
    with TestClient(app) as client:
        _wait(lambda: failures)
        body = assert_error_shape(client.get("/health"), 503)
        assert "no weights" in body["message"]
        assert_error_shape(client.post("/v1/completions", json={"prompt": "hi"}), 503)
        assert_error_shape(client.get("/v1/models"), 503)


def test_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [card["id"] for card in body["data"]] == ["fake-model", "alias"]
    card = body["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "paphos" and card["root"] == "/models/fake"
    assert card["max_model_len"] == 256 and card["parent"] is None and isinstance(card["permission"], list)


def test_tokenize_prompt(client):
    for path in ("/v1/tokenize", "/tokenize"):
        body = client.post(path, json={"prompt": "hi"}).json()
        assert body == {"count": 3, "max_model_len": 256, "tokens": [1, 104, 105], "token_strs": None}
    body = client.post("/v1/tokenize", json={"prompt": "hi", "add_special_tokens": False, "return_token_strs": True}).json()
    assert body["tokens"] == [104, 105] and body["token_strs"] == ["h", "i"]


def test_tokenize_chat(client):
    body = client.post("/v1/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert body["count"] == len("<user>hi\n<assistant>")
    assert body["tokens"][0] == ord("<")


def test_tokenize_errors(client):
    assert_error_shape(client.post("/v1/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}), 400)
    assert_error_shape(client.post("/v1/tokenize", json={}), 400)
    assert_error_shape(client.post("/v1/tokenize", json={"prompt": "a", "model": "x"}), 404, param="model")
    assert client.post("/v1/tokenize", json={"prompt": "a", "model": "alias"}).status_code == 200


def test_detokenize(client):
    for path in ("/v1/detokenize", "/detokenize"):
        assert client.post(path, json={"tokens": [1, 104, 105]}).json() == {"prompt": "<s>hi"}
    assert_error_shape(client.post("/v1/detokenize", json={"tokens": [104, 128]}), 400, param="tokens")
    assert_error_shape(client.post("/v1/detokenize", json={"tokens": [-1]}), 400, param="tokens")
    assert_error_shape(client.post("/v1/detokenize", json={"tokens": "abc"}), 400, param="tokens")
    assert client.post("/v1/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_docs_can_be_disabled():
    with TestClient(make_app(FakeEngine())) as client:
        assert client.get("/docs").status_code == 200 and client.get("/openapi.json").status_code == 200
    with TestClient(make_app(FakeEngine(), disable_fastapi_docs=True)) as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert_error_shape(client.get(path), 404)
