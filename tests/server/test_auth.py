"""Auth matrix (contract §2.1, §2.2): no key / wrong key / user key / admin key, on open, user and
admin routes, with both header styles, under three configurations; CORS preflights; SillyTavern's
keyless Kobold-classic calls against a keyed server and the limits of the keyless Kobold routes."""

from __future__ import annotations

import threading
import time

import pytest
from starlette.testclient import TestClient

from paphos import cli
from paphos.server.auth import PUBLIC_MAX_BODY_BYTES, Access, classify
from tests.server.fakes import FakeEngine, assert_error_shape, make_app

USER, ADMIN = "user-key-1", "admin-key"

OPEN = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/.well-known/serviceinfo"),
        ("GET", "/api/v1/info/version"), ("GET", "/api/latest/info/version"), ("GET", "/api/extra/version"),
        # Kobold status and token counts, open as under KoboldCpp's --password (SillyTavern sends no key).
        ("GET", "/api/v1/model"), ("GET", "/api/latest/model"), ("GET", "/api/v1/config/max_length"),
        ("GET", "/api/v1/config/max_context_length"), ("GET", "/api/latest/config/max_context_length"),
        ("GET", "/api/extra/true_max_context_length"), ("POST", "/api/extra/tokencount"),
        ("POST", "/api/extra/tokenize"), ("POST", "/api/extra/abort")]
PROTECTED = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"), ("POST", "/api/v1/generate"),
             ("POST", "/api/extra/generate/stream"), ("POST", "/api/extra/generate/check"),
             ("POST", "/api/extra/detokenize"), ("POST", "/api/extra/last_logprobs"), ("GET", "/api/extra/perf"),
             ("POST", "/api/v1/model"), ("GET", "/api/extra/tokencount")]
ADMIN_ROUTES = [("POST", "/v1/lora/load"), ("DELETE", "/v1/lora/unload"), ("POST", "/v1/load_lora_adapter"),
                ("POST", "/v1/unload_lora_adapter"), ("POST", "/v1/model/load"), ("POST", "/v1/soft_prompt/set")]
BODIES = {"/v1/completions": {"prompt": "hi", "max_tokens": 1}, "/tokenize": {"prompt": "hi"},
          "/api/v1/generate": {"prompt": "hi", "max_length": 1}, "/api/extra/tokencount": {"prompt": "hi"},
          "/api/extra/tokenize": {"prompt": "hi"}, "/api/extra/generate/stream": {"prompt": "hi", "max_length": 1},
          "/api/extra/detokenize": {"ids": [104]}}


def _client(**config) -> TestClient:
    return TestClient(make_app(FakeEngine(), **config), raise_server_exceptions=False)


def _send(client, method, path, key=None, style="bearer"):
    headers = {}
    if key is not None:
        headers = {"Authorization": f"Bearer {key}"} if style == "bearer" else {"X-API-Key": key}
    return client.request(method, path, headers=headers, json=BODIES.get(path))


def _is_unauthorized(response) -> bool:
    if response.status_code != 401:
        return False
    assert response.json() == {"error": "Unauthorized"}  # Aphrodite's exact body
    return True


@pytest.fixture(scope="module")
def clients():
    configs = {"none": {}, "user": {"api_keys": (USER, "user-key-2")},
               "both": {"api_keys": (USER,), "admin_key": ADMIN}, "admin_only": {"admin_key": ADMIN}}
    opened = {name: _client(**config) for name, config in configs.items()}
    for client in opened.values():
        client.__enter__()
        for _ in range(200):
            if client.get("/health").status_code == 200:
                break
    yield opened
    for client in opened.values():
        client.__exit__(None, None, None)


@pytest.mark.parametrize("style", ["bearer", "x-api-key"])
@pytest.mark.parametrize("key", [None, "wrong", USER, ADMIN])
def test_matrix(clients, key, style):
    for config, client in clients.items():
        user_auth = config in ("user", "both")
        admin_key_set = config in ("both", "admin_only")
        for method, path in OPEN:
            r = _send(client, method, path, key, style)
            assert r.status_code == 200, (config, path, key, r.text)
        for method, path in PROTECTED:
            r = _send(client, method, path, key, style)
            accepted = not user_auth or key == USER or (key == ADMIN and admin_key_set)
            assert _is_unauthorized(r) != accepted, (config, path, key, r.status_code, r.text)
            if accepted:  # past auth; a wrong method is the router's 405
                assert r.status_code in (200, 405), (config, path, key, r.text)
        for method, path in ADMIN_ROUTES:
            r = _send(client, method, path, key, style)
            if not admin_key_set:
                # Closed for everyone, whatever the key (no "loopback only" exception).
                assert_error_shape(r, 403, "PermissionDeniedError")
            elif key == ADMIN:
                assert r.status_code not in (401, 403), (config, path)  # passes auth (then 400 or 404: no body)
            else:
                assert _is_unauthorized(r), (config, path, key)


def test_bearer_scheme_is_case_insensitive(clients):
    client = clients["user"]
    assert client.get("/v1/models", headers={"Authorization": f"bearer {USER}"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": f"Basic {USER}"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer user-key-2"}).status_code == 200


def test_preflight_needs_no_key_and_allows_auth_headers(clients):
    client = clients["both"]
    for path in ("/v1/completions", "/api/v1/generate", "/v1/lora/load"):
        r = client.options(path, headers={
            "Origin": "https://st.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, x-api-key, content-type",
        })
        assert r.status_code == 200, (path, r.text)
        assert r.headers["access-control-allow-origin"] in ("*", "https://st.example")
        allowed = r.headers["access-control-allow-headers"].lower()
        assert all(h in allowed for h in ("authorization", "x-api-key", "content-type"))
    # A refused request still carries CORS headers, so the browser shows the 401.
    r = client.get("/v1/models", headers={"Origin": "https://st.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"


def test_cors_flags():
    client = _client(allowed_origins=("https://a.example",), allowed_methods=("GET", "POST"))
    with client:
        ok = client.options("/v1/models", headers={"Origin": "https://a.example", "Access-Control-Request-Method": "GET"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://a.example"
        bad = client.options("/v1/models", headers={"Origin": "https://b.example", "Access-Control-Request-Method": "GET"})
        assert bad.status_code == 400


def test_kobold_version_reports_protected(clients):
    assert clients["none"].get("/api/extra/version").json()["protected"] is False
    assert clients["user"].get("/api/extra/version").json()["protected"] is True


def test_classify():
    assert classify("OPTIONS", "/v1/lora/load") is Access.PUBLIC
    assert classify("GET", "/health/") is Access.PUBLIC
    assert classify("POST", "/health") is Access.USER
    assert classify("GET", "/v1/lora/list") is Access.ADMIN
    assert classify("GET", "/api/v1/model") is Access.PUBLIC
    assert classify("POST", "/api/v1/model") is Access.USER
    assert classify("POST", "/api/extra/abort/") is Access.PUBLIC
    assert classify("GET", "/api/extra/tokencount") is Access.USER
    assert classify("POST", "/api/extra/detokenize") is Access.USER
    assert classify("POST", "/api/extra/generate/check") is Access.USER


def test_keys_from_flags_and_env(monkeypatch):
    monkeypatch.setenv(cli.API_KEY_ENV, "env-key")
    monkeypatch.setenv(cli.ADMIN_KEY_ENV, "env-admin")
    _, server = cli.build_configs(cli.parse_args(["run", "m.gguf"]))
    assert server.api_keys == ("env-key",) and server.admin_key == "env-admin"
    # The flag replaces the env key (several keys allowed); --admin-key wins over its env var.
    _, server = cli.build_configs(cli.parse_args(["run", "m.gguf", "--api-keys", "a", "b", "--admin-key", "x"]))
    assert server.api_keys == ("a", "b") and server.admin_key == "x"
    _, server = cli.build_configs(cli.parse_args(["run", "m.gguf", "--api-key", "c"]))
    assert server.api_keys == ("c",)
    # Keys never show up in a logged config.
    assert "api_keys" not in repr(server) and "admin_key" not in repr(server) and "'x'" not in repr(server)


def test_root_path_prefix_is_classified_like_the_bare_path():
    with TestClient(make_app(FakeEngine(), api_keys=(USER,)), root_path="/paphos") as client:
        assert client.get("/paphos/version").status_code == 200
        assert client.get("/paphos/v1/models").status_code == 401
        assert "detail" in client.post("/paphos/api/v1/generate", json={}, headers={"X-API-Key": USER}).json()


def _addressed(app):
    """The app, with each request's client address taken from an `X-Test-Client` header."""
    async def shim(scope, receive, send):
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"x-test-client":
                    scope = {**scope, "client": (value.decode(), 1)}
        await app(scope, receive, send)
    return shim


@pytest.fixture
def keyed():
    engine = FakeEngine()
    with TestClient(_addressed(make_app(engine, api_keys=(USER,))), raise_server_exceptions=False) as client:
        for _ in range(400):
            if engine.is_ready:
                break
            time.sleep(0.005)
        yield client


def _generate_in_thread(client, body, **headers):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault(
        "r", client.post("/api/v1/generate", json=body, headers={"X-API-Key": USER, **headers})))
    thread.start()
    return thread, result


def _wait_running(client, genkey=None):
    deadline = time.monotonic() + 5
    while not client.post("/api/extra/generate/check", json={"genkey": genkey} if genkey else {},
                          headers={"X-API-Key": USER}).json()["results"][0]["text"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_sillytavern_kobold_classic_with_keys(keyed):
    """SillyTavern's exact Kobold-classic calls: status and abort bare, generation with an override header."""
    assert keyed.get("/api/v1/info/version").json() == {"result": "1.2.4"}
    version = keyed.get("/api/extra/version").json()
    assert version["result"] == "KoboldCpp" and version["protected"] is True
    assert keyed.get("/api/v1/model").json() == {"result": "aphrodite/fake-model"}
    assert keyed.get("/api/v1/config/max_context_length").json() == {"value": 256}
    assert keyed.get("/api/extra/true_max_context_length").json() == {"value": 256}
    assert keyed.get("/api/v1/config/max_length").json() == {"value": 200}
    count = keyed.post("/api/extra/tokencount", json={"prompt": "hello"}).json()
    assert count == {"value": 5, "ids": [104, 101, 108, 108, 111]}
    gui = {"prompt": "hi", "use_story": False, "use_memory": False, "use_authors_note": False,
           "use_world_info": False, "max_context_length": 128, "max_length": 3}
    # Generation and everything that reads a generation's text stay behind the key.
    assert _is_unauthorized(keyed.post("/api/v1/generate", json=gui))
    assert _is_unauthorized(keyed.post("/api/extra/generate/stream", json=gui))
    assert _is_unauthorized(keyed.post("/api/extra/generate/check"))
    r = keyed.post("/api/v1/generate", json=gui, headers={"Authorization": f"Bearer {USER}"})
    assert r.status_code == 200 and r.json()["results"][0]["text"] == "abc"

    # The bodiless, keyless abort SillyTavern sends is answered (no 401 in its log) but stops nothing:
    # a stranger at the same address (a reverse proxy) could send it too.
    thread, result = _generate_in_thread(keyed, {**gui, "prompt": "SLOW", "max_length": 100})
    _wait_running(keyed)
    r = keyed.post("/api/extra/abort")
    assert r.status_code == 200 and r.json() == {"success": False}
    # With the key, the bodiless abort stops the caller's genkey-less generation.
    assert keyed.post("/api/extra/abort", headers={"X-API-Key": USER}).json() == {"success": True}
    thread.join(5)
    assert result["r"].json()["results"][0]["finish_reason"] == "abort"


def test_keyless_abort_needs_the_genkey_and_the_generating_address(keyed):
    thread, result = _generate_in_thread(
        keyed, {"prompt": "SLOW", "max_length": 100, "genkey": "KCPP4321"}, **{"X-Test-Client": "10.0.0.1"})
    _wait_running(keyed, "KCPP4321")
    stranger = {"X-Test-Client": "10.0.0.2"}
    assert keyed.post("/api/extra/abort", json={"genkey": "KCPP4321"}, headers=stranger).json() == {"success": False}
    assert keyed.post("/api/extra/abort", json={"genkey": "other"}, headers={"X-Test-Client": "10.0.0.1"}).json() == {
        "success": False}
    owner = {"X-Test-Client": "10.0.0.1"}
    assert keyed.post("/api/extra/abort", json={"genkey": "KCPP4321"}, headers=owner).json() == {"success": True}
    thread.join(5)
    assert result["r"].json()["results"][0]["finish_reason"] == "abort"
    # A key may abort any genkey, from anywhere (key holders are trusted alike).
    thread, result = _generate_in_thread(keyed, {"prompt": "SLOW", "max_length": 100, "genkey": "K2"}, **owner)
    _wait_running(keyed, "K2")
    assert keyed.post("/api/extra/abort", json={"genkey": "K2"}, headers={**stranger, "X-API-Key": USER}).json() == {
        "success": True}
    thread.join(5)


def test_keyless_public_routes_bound_their_input(keyed):
    big = {"prompt": "a" * (PUBLIC_MAX_BODY_BYTES + 10)}
    for path in ("/api/extra/tokencount", "/api/extra/tokenize", "/api/extra/abort"):
        body = assert_error_shape(keyed.post(path, json=big), 413, "RequestTooLargeError")
        assert body["detail"]["msg"] == body["message"]  # Kobold routes add `detail`
    # Without a Content-Length the limit applies while the body streams in.
    chunks = (b'{"prompt": "' + b"a" * 65536, *([b"a" * 65536] * 20), b'"}')
    assert_error_shape(keyed.post("/api/extra/tokencount", content=iter(chunks)), 413)
    # A key lifts the small limit (the server-wide one still applies).
    r = keyed.post("/api/extra/tokencount", json=big, headers={"X-API-Key": USER})
    assert r.status_code == 200 and r.json()["value"] == PUBLIC_MAX_BODY_BYTES + 10
    # Malformed input: 400 in the error shape (with KoboldCpp's `value: -1` for token counts).
    r = keyed.post("/api/extra/tokencount", content=b"[1, 2]")
    assert assert_error_shape(r, 400)["value"] == -1
    assert_error_shape(keyed.post("/api/extra/abort", content=b"{"), 400)
    assert_error_shape(keyed.post("/api/extra/abort", json={"genkey": 5}), 400)
