"""LoRA on the HTTP side (contract §3.3, §3.6, §5.1), against the fake engine with a real adapter
registry whose validation is `fake_validate_adapter`: the four admin routes (bodies, statuses,
errors, auth tiers), /v1/models after load and unload, and the adapter a request's `model` (Kobold:
`lora`) selects reaching `engine.generate`, with the adapter's name echoed."""

from __future__ import annotations

import json
import time

import pytest
from starlette.testclient import TestClient

from tests.server.fakes import FakeEngine, assert_error_shape, fake_validate_adapter, make_app, sse_events

USER, ADMIN = "user-key", "admin-key"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}
PROMPT = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(autouse=True)
def fake_peft(monkeypatch):
    # Registration validates through paphos.lora.peft.validate_adapter (read when called): the
    # fake decides by the path's name, with no files.
    monkeypatch.setattr("paphos.lora.peft.validate_adapter", fake_validate_adapter)


def _open(engine: FakeEngine, **config) -> TestClient:
    client = TestClient(make_app(engine, **config), raise_server_exceptions=False)
    client.__enter__()
    for _ in range(400):
        if engine.is_ready:
            break
        time.sleep(0.005)
    return client


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(enable_lora=True)


@pytest.fixture
def client(engine):
    # User routes open (no API keys), admin routes behind the admin key.
    client = _open(engine, admin_key=ADMIN)
    yield client
    client.__exit__(None, None, None)


def _load(client, name="style", path="adapters/style", **extra):
    return client.post("/v1/lora/load", json={"name": name, "path": path, **extra}, headers=AS_ADMIN)


def _model_cards(client) -> dict[str, dict]:
    r = client.get("/v1/models")
    assert r.status_code == 200
    return {card["id"]: card for card in r.json()["data"]}


def _last_lora(engine):
    return engine.loras[engine.calls[-1][0]]


# --- the admin routes ----------------------------------------------------------------------------


def test_lora_load_and_unload(client, engine):
    r = _load(client)
    assert r.status_code == 200 and r.json() == {"status": "success"}
    lora = engine.lora_registry.get("style")
    assert lora is not None and lora.path == "/resolved/adapters/style"
    r = client.delete("/v1/lora/unload", params={"lora_name": "style"}, headers=AS_ADMIN)
    assert r.status_code == 200 and r.json() == {"status": "success"}
    assert engine.lora_registry.get("style") is None


def test_load_lora_adapter_and_unload_lora_adapter_answer_text(client, engine):
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "tone", "lora_path": "org/tone-lora"},
                    headers=AS_ADMIN)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert r.text == "Success: LoRA adapter 'tone' added successfully."
    assert engine.lora_registry.get("tone") is not None
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "tone"}, headers=AS_ADMIN)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == "Success: LoRA adapter 'tone' removed successfully."
    assert engine.lora_registry.get("tone") is None


def test_load_inplace_replaces_and_duplicates_are_refused(client, engine):
    assert _load(client).status_code == 200
    first = engine.lora_registry.get("style")
    # The same name again: 400 on both spellings unless load_inplace.
    assert_error_shape(_load(client, path="adapters/other"), 400, "BadRequestError")
    body = {"lora_name": "style", "lora_path": "adapters/other"}
    assert_error_shape(client.post("/v1/load_lora_adapter", json=body, headers=AS_ADMIN), 400)
    assert engine.lora_registry.get("style") == first
    r = client.post("/v1/load_lora_adapter", json={**body, "load_inplace": True}, headers=AS_ADMIN)
    assert r.status_code == 200, r.text
    second = engine.lora_registry.get("style")
    # A new id, so nothing cached for the old weights can be mistaken for the new ones.
    assert second.path == "/resolved/adapters/other" and second.lora_id != first.lora_id
    assert client.post("/v1/completions", json={**PROMPT, "model": "style"}).status_code == 200
    assert _last_lora(engine) == second


@pytest.mark.parametrize(("path", "status", "message"), [
    ("adapters/MISSING", 404, "no adapter at"),
    ("adapters/RANK64", 400, "--max-lora-rank"),
    ("adapters/BADCONFIG", 400, "adapter_config.json"),
])
def test_load_errors(client, engine, path, status, message):
    body = assert_error_shape(_load(client, path=path), status, param="path" if status == 404 else None)
    assert message in body["message"]
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "style", "lora_path": path}, headers=AS_ADMIN)
    assert message in assert_error_shape(r, status, param="lora_path" if status == 404 else None)["message"]
    # Validation is eager: a refused adapter is never registered, listed or usable.
    assert engine.lora_registry.get("style") is None and "style" not in _model_cards(client)


def test_base_model_names_cannot_be_adapter_names(client):
    for name in ("fake-model", "alias", ""):
        assert_error_shape(_load(client, name=name), 400)


def test_unload_unknown_is_404(client):
    r = client.delete("/v1/lora/unload", params={"lora_name": "nope"}, headers=AS_ADMIN)
    assert_error_shape(r, 404, "NotFoundError", param="lora_name")
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=AS_ADMIN)
    assert_error_shape(r, 404, "NotFoundError", param="lora_name")


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/lora/load", {"name": "style"}),  # no path
    ("POST", "/v1/lora/load", {"name": 3, "path": "adapters/style"}),
    ("POST", "/v1/lora/load", None),
    ("POST", "/v1/load_lora_adapter", {"lora_path": "adapters/style"}),  # no lora_name
    ("POST", "/v1/load_lora_adapter", {"lora_name": "s", "lora_path": "p", "load_inplace": "maybe"}),
    ("POST", "/v1/unload_lora_adapter", {}),
    ("DELETE", "/v1/lora/unload", None),  # no lora_name query
])
def test_bad_bodies_are_400(client, method, path, body):
    r = client.request(method, path, json=body, headers=AS_ADMIN)
    assert_error_shape(r, 400, "BadRequestError")


def test_unload_without_lora_name_names_the_field(client):
    body = assert_error_shape(client.delete("/v1/lora/unload", headers=AS_ADMIN), 400, param="lora_name")
    assert body["message"] == "1 invalid field: lora_name: Field required"


def test_malformed_json_is_400(client):
    r = client.post("/v1/lora/load", content=b"{not json", headers=AS_ADMIN)
    assert_error_shape(r, 400, "BadRequestError")


def test_admin_routes_when_lora_is_disabled():
    client = _open(FakeEngine(), admin_key=ADMIN)
    try:
        body = assert_error_shape(_load(client), 400, "BadRequestError")
        assert "--enable-lora" in body["message"]
        assert_error_shape(client.delete("/v1/lora/unload", params={"lora_name": "x"}, headers=AS_ADMIN), 400)
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "p"}, headers=AS_ADMIN)
        assert_error_shape(r, 400)
        assert_error_shape(client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=AS_ADMIN), 400)
    finally:
        client.__exit__(None, None, None)


def test_admin_routes_503_while_loading():
    engine = FakeEngine(enable_lora=True, ready_on_start=False)
    with TestClient(make_app(engine, admin_key=ADMIN), raise_server_exceptions=False) as client:
        assert_error_shape(_load(client), 503, "ServiceUnavailableError")
        # Until the engine is ready there are no adapter names: only the served names are listed.
        assert set(_model_cards(client)) == {"fake-model", "alias"}
        engine.hold = False


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/lora/load", {"name": "style", "path": "adapters/style"}),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "style", "lora_path": "adapters/style"}),
])
def test_auth_tiers(method, path, body):
    """User key 401, admin key 200, no admin key configured 403 for everyone (contract §2.1)."""
    engine = FakeEngine(enable_lora=True)
    client = _open(engine, api_keys=(USER,), admin_key=ADMIN)
    closed = _open(FakeEngine(enable_lora=True), api_keys=(USER,))
    try:
        for key in (None, USER, "wrong"):
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            r = client.request(method, path, json=body, headers=headers)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (key, r.text)
            unload = client.delete("/v1/lora/unload", params={"lora_name": "style"}, headers=headers)
            assert unload.status_code == 401
        assert engine.lora_registry.get("style") is None
        r = client.request(method, path, json=body, headers={"X-API-Key": ADMIN})
        assert r.status_code == 200, r.text
        # The loaded adapter serves a user-key request; the admin key works on user routes too.
        for key in (USER, ADMIN):
            r = client.post("/v1/completions", json={**PROMPT, "model": "style"}, headers={"X-API-Key": key})
            assert r.status_code == 200 and r.json()["model"] == "style"
        r = client.post("/v1/unload_lora_adapter", json={"lora_name": "style"}, headers=AS_ADMIN)
        assert r.status_code == 200
        for key in (None, USER, ADMIN):
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            assert_error_shape(closed.request(method, path, json=body, headers=headers), 403, "PermissionDeniedError")
    finally:
        client.__exit__(None, None, None)
        closed.__exit__(None, None, None)


# --- /v1/models ------------------------------------------------------------------------------------


def test_models_list_adapters_after_load_and_not_after_unload(client):
    assert list(_model_cards(client)) == ["fake-model", "alias"]
    assert _load(client).status_code == 200
    assert _load(client, name="tone", path="org/tone", base_model_name="alias").status_code == 200
    cards = _model_cards(client)
    assert list(cards) == ["fake-model", "alias", "style", "tone"]
    base, style, tone = cards["fake-model"], cards["style"], cards["tone"]
    assert style["root"] == "/resolved/adapters/style" and style["parent"] == "fake-model"
    assert tone["root"] == "/resolved/org/tone" and tone["parent"] == "alias"
    assert base["root"] == "/models/fake" and base["parent"] is None
    for card in (style, tone):
        assert card["object"] == "model" and card["owned_by"] == "paphos"
        assert card["max_model_len"] == base["max_model_len"] and card["permission"]
    assert client.delete("/v1/lora/unload", params={"lora_name": "style"}, headers=AS_ADMIN).status_code == 200
    assert list(_model_cards(client)) == ["fake-model", "alias", "tone"]


# --- model selection -------------------------------------------------------------------------------


def test_completions_run_with_the_adapter_and_echo_its_name(client, engine):
    assert _load(client).status_code == 200
    lora = engine.lora_registry.get("style")
    r = client.post("/v1/completions", json={**PROMPT, "model": "style"})
    assert r.status_code == 200 and r.json()["model"] == "style"
    assert _last_lora(engine) == lora
    # Several prompts: every engine request carries the adapter.
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1, "model": "style"})
    assert r.status_code == 200
    assert [engine.loras[call[0]] for call in engine.calls[-2:]] == [lora, lora]
    # Base names (and no model at all) run without one and echo the first served name.
    for model in ("alias", "fake-model", None):
        r = client.post("/v1/completions", json={**PROMPT, "model": model})
        assert r.status_code == 200 and r.json()["model"] == "fake-model"
        assert _last_lora(engine) is None


def test_streamed_completion_with_adapter(client, engine):
    assert _load(client).status_code == 200
    r = client.post("/v1/completions", json={**PROMPT, "model": "style", "stream": True,
                                             "stream_options": {"include_usage": True}})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert chunks and all(c["model"] == "style" for c in chunks)
    assert _last_lora(engine) == engine.lora_registry.get("style")


def test_chat_with_adapter(client, engine):
    assert _load(client).status_code == 200
    lora = engine.lora_registry.get("style")
    messages = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "model": "style"})
    assert r.status_code == 200 and r.json()["model"] == "style"
    assert _last_lora(engine) == lora
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "model": "style",
                                                  "stream": True})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert chunks and all(c["model"] == "style" for c in chunks)
    assert _last_lora(engine) == lora


def test_unknown_and_unloaded_adapter_is_404(client, engine):
    calls = len(engine.calls)
    for route, body in (("/v1/completions", PROMPT),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/tokenize", {"prompt": "hi"}), ("/v1/detokenize", {"tokens": [104]})):
        r = client.post(route, json={**body, "model": "style"})
        body = assert_error_shape(r, 404, "NotFoundError", param="model")
        assert body["message"] == "The model `style` does not exist."
    assert _load(client).status_code == 200
    assert client.post("/v1/completions", json={**PROMPT, "model": "style"}).status_code == 200
    assert client.delete("/v1/lora/unload", params={"lora_name": "style"}, headers=AS_ADMIN).status_code == 200
    assert_error_shape(client.post("/v1/completions", json={**PROMPT, "model": "style"}), 404, param="model")
    assert len(engine.calls) == calls + 1


def test_tokenize_accepts_adapter_names(client):
    assert _load(client).status_code == 200
    base = client.post("/v1/tokenize", json={"prompt": "hi"}).json()
    r = client.post("/v1/tokenize", json={"prompt": "hi", "model": "style"})
    assert r.status_code == 200 and r.json() == base
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "model": "style"})
    assert r.status_code == 200
    r = client.post("/v1/detokenize", json={"tokens": [104, 105], "model": "style"})
    assert r.status_code == 200 and r.json() == {"prompt": "hi"}


def test_kobold_lora_field(client, engine):
    assert _load(client).status_code == 200
    lora = engine.lora_registry.get("style")
    r = client.post("/api/v1/generate", json={"prompt": "hi", "max_length": 2, "lora": "style"})
    assert r.status_code == 200, r.text
    assert _last_lora(engine) == lora
    r = client.post("/api/extra/generate/stream", json={"prompt": "hi", "max_length": 2, "lora": "style"})
    assert r.status_code == 200 and r.text.endswith('"finish_reason":"length"}\n\n')
    assert _last_lora(engine) == lora
    for empty in (None, ""):
        r = client.post("/api/v1/generate", json={"prompt": "hi", "max_length": 2, "lora": empty})
        assert r.status_code == 200 and _last_lora(engine) is None
    # Only adapter names: a base name is not an adapter.
    for name in ("nope", "fake-model"):
        r = client.post("/api/v1/generate", json={"prompt": "hi", "lora": name})
        body = assert_error_shape(r, 404, "NotFoundError", param="lora")
        assert body["detail"] == {"msg": body["message"], "type": "NotFoundError"}
        r = client.post("/api/extra/generate/stream", json={"prompt": "hi", "lora": name})
        assert_error_shape(r, 404, param="lora")


def test_lora_disabled():
    client = _open(FakeEngine(), admin_key=ADMIN)
    try:
        # Kobold `lora` while LoRA is off: 400 (contract §2.3), even for an empty registry's miss.
        for route in ("/api/v1/generate", "/api/extra/generate/stream"):
            body = assert_error_shape(client.post(route, json={"prompt": "hi", "lora": "style"}), 400, param="lora")
            assert "not enabled" in body["message"] and body["detail"]["msg"] == body["message"]
        assert client.post("/api/v1/generate", json={"prompt": "hi", "max_length": 1, "lora": ""}).status_code == 200
        # An OpenAI `model` that is no served name is simply unknown.
        assert_error_shape(client.post("/v1/completions", json={**PROMPT, "model": "style"}), 404, param="model")
        assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["fake-model", "alias"]
    finally:
        client.__exit__(None, None, None)


def test_metrics_list_the_adapters_in_use(client):
    assert _load(client).status_code == 200
    text = client.get("/metrics").text
    line = next(line for line in text.splitlines() if line.startswith("aphrodite:lora_requests_info{"))
    assert 'running_lora_adapters="style"' in line and 'max_lora="1"' in line
