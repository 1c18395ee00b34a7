"""End to end over HTTP: `python -m paphos run --enable-lora` on a tiny random Llama with PEFT
adapters. The adapter travels from the route through the engine-core process boundary (msgpack)
to the device slots: each request's greedy tokens are the PEFT-merged model's; an adapter loaded
at run time by the admin route serves at once and is gone once unloaded."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.engine.test_hf_parity import hf_greedy
from tests.lora.peft_fixtures import Adapter, TinyLlama, make_adapter, write_tiny_llama
from tests.server.spawn import spawn_server

ADMIN = {"Authorization": "Bearer admin-secret"}
PROMPT = [5, 17, 33, 8, 61, 12, 40, 7, 9]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyLlama, dict[str, Adapter], Path]:
    folder = tmp_path_factory.mktemp("lora-server")
    base = write_tiny_llama(folder / "base")
    adapters = {name: make_adapter(base, folder / name, rank=8, seed=seed) for name, seed in (("first", 1), ("late", 2))}
    return base, adapters, folder


@pytest.fixture(scope="module")
def server(setup) -> str:
    base, adapters, folder = setup
    with spawn_server(folder, "--model", str(base.path), "--dtype", "float32", "--max-model-len", "256", "--enable-lora", "--max-loras", "2",
                      "--lora-modules", f"first={adapters['first'].path}", "--admin-key", "admin-secret",
                      "--return-tokens-as-token-ids") as base_url:  # fmt: skip
        yield base_url


def _greedy_ids(server: str, model: str) -> list[int]:
    r = httpx.post(f"{server}/v1/completions", json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0, "ignore_eos": True,
    }, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


def test_requests_get_their_adapters_output_through_the_server(server, setup) -> None:
    base, adapters, _ = setup
    assert _greedy_ids(server, "first") == hf_greedy(adapters["first"].merged, PROMPT, 8)
    assert _greedy_ids(server, "smol") == hf_greedy(base.model, PROMPT, 8)
    cards = {c["id"]: c for c in httpx.get(f"{server}/v1/models").json()["data"]}
    assert cards["first"]["parent"] == "smol" and cards["first"]["root"] == str(adapters["first"].path)


def test_an_adapter_loaded_at_run_time_serves_at_once_and_unloads(server, setup) -> None:
    _, adapters, _ = setup
    r = httpx.post(f"{server}/v1/load_lora_adapter", headers=ADMIN,
                   json={"lora_name": "late", "lora_path": str(adapters["late"].path)})  # fmt: skip
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully."
    assert _greedy_ids(server, "late") == hf_greedy(adapters["late"].merged, PROMPT, 8)
    # EOS bypassed: Kobold samples by default, and a random model may sample EOS within four tokens
    r = httpx.post(f"{server}/api/v1/generate", json={"prompt": "w5 w17", "max_length": 4, "lora": "late",
                                                       "bypass_eos": True}, timeout=120)  # fmt: skip
    assert r.status_code == 200 and r.json()["results"][0]["finish_reason"] == "length"
    r = httpx.request("DELETE", f"{server}/v1/lora/unload", params={"lora_name": "late"}, headers=ADMIN)
    assert r.json() == {"status": "success"}
    r = httpx.post(f"{server}/v1/completions", json={"model": "late", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and "late" in json.dumps(r.json())
    metrics = httpx.get(f"{server}/metrics").text
    assert 'max_lora="2"' in metrics
