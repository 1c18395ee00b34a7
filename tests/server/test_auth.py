"""Auth matrix (contract §2.1, §2.2): no key / wrong key / user key / admin key, on open, user and
admin routes, with both header styles, under three configurations; CORS preflights."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from paphos import cli
from paphos.server.auth import Access, classify
from tests.server.fakes import FakeEngine, assert_error_shape, make_app

USER, ADMIN = "user-key-1", "admin-key"

OPEN = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/.well-known/serviceinfo"),
        ("GET", "/api/v1/info/version"), ("GET", "/api/latest/info/version"), ("GET", "/api/extra/version")]
PROTECTED = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"), ("GET", "/api/v1/model"),
             ("POST", "/api/v1/generate"), ("POST", "/api/extra/tokencount"), ("POST", "/api/extra/abort")]
ADMIN_ROUTES = [("POST", "/v1/lora/load"), ("DELETE", "/v1/lora/unload"), ("POST", "/v1/load_lora_adapter"),
                ("POST", "/v1/unload_lora_adapter"), ("POST", "/v1/model/load"), ("POST", "/v1/soft_prompt/set")]
BODIES = {"/v1/completions": {"prompt": "hi", "max_tokens": 1}, "/tokenize": {"prompt": "hi"},
          "/api/v1/generate": {"prompt": "hi", "max_length": 1}, "/api/extra/tokencount": {"prompt": "hi"}}


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
            assert _send(client, method, path, key, style).status_code == 200, (config, path, key)
        for method, path in PROTECTED:
            r = _send(client, method, path, key, style)
            accepted = not user_auth or key == USER or (key == ADMIN and admin_key_set)
            assert _is_unauthorized(r) != accepted, (config, path, key, r.status_code, r.text)
        for method, path in ADMIN_ROUTES:
            r = _send(client, method, path, key, style)
            if not admin_key_set:
                # Closed for everyone, whatever the key (no "loopback only" exception).
                assert_error_shape(r, 403, "PermissionDeniedError")
            elif key == ADMIN:
                assert r.status_code not in (401, 403), (config, path)  # passes auth (no LoRA routes yet: 404)
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
    assert classify("GET", "/api/v1/model") is Access.USER


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
