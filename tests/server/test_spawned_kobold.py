"""End to end against `python -m paphos run` with the default model (the session's one server):
every Kobold route's exact keys and status, the stream framing, the `koboldapi` PyPI client,
/metrics counters moving by exact amounts, and abort by genkey freeing the request's blocks."""

from __future__ import annotations

import importlib
import importlib.util
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.spawn import NAME


@pytest.fixture(scope="module")
def http(spawned_server: str):
    with httpx.Client(base_url=spawned_server, timeout=120) as client:
        yield client


def metrics(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample, parsed by prometheus_client: {(name, sorted labels without model_name): value}."""
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if sample.name.startswith(("aphrodite:", "paphos:")):
                assert labels.pop("model_name") == NAME
            samples[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return samples


def metric(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def wait_idle(http: httpx.Client, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if metric(m, "aphrodite:num_requests_running") == 0 and metric(m, "aphrodite:num_requests_waiting") == 0:
            return m
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)


def wait_running(http: httpx.Client) -> None:
    deadline = time.monotonic() + 30
    while metric(metrics(http), "aphrodite:num_requests_running") == 0:
        assert time.monotonic() < deadline, "the request did not start"
        time.sleep(0.02)


def kobold_events(text: str) -> list[dict]:
    assert text.endswith("\n\n") and "[DONE]" not in text
    events = []
    for block in text.split("\n\n")[:-1]:
        event, data = block.split("\n")
        assert event == "event: message" and data.startswith("data: ")
        events.append(json.loads(data[len("data: "):]))
    return events


# ---- exact shapes of every route -----------------------------------------------------------------


@pytest.mark.parametrize("base", ["/api/v1", "/api/latest"])
def test_v1_routes(http, base):
    expected = {
        "/info/version": {"result": "1.2.4"},
        "/model": {"result": f"aphrodite/{NAME}"},
        "/config/max_length": {"value": 200},
        "/config/max_context_length": {"value": 2048},
        "/config/soft_prompts_list": {"values": []},
        "/config/soft_prompt": {"value": ""},
    }
    for path, body in expected.items():
        r = http.get(base + path)
        assert r.status_code == 200 and r.json() == body, path
    r = http.put(base + "/config/soft_prompt", json={"value": ""})
    assert r.status_code == 200 and r.json() == {}


def test_extra_info_routes(http):
    assert http.get("/api/extra/version").json() == {
        "result": "KoboldCpp", "version": "1.63", "protected": False, "txt2img": False, "vision": False}
    assert http.get("/api/extra/true_max_context_length").json() == {"value": 2048}
    assert http.get("/api/extra/preloadstory").json() == {}
    perf = http.get("/api/extra/perf").json()
    assert {"last_process", "last_eval", "last_token_count", "total_gens", "queue", "idle"} <= set(perf)
    info = http.get("/.well-known/serviceinfo").json()
    assert info["version"] == 0.2 and info["api"]["koboldai"]["rel_url"] == "/api"
    assert info["api"]["openai"]["rel_url"] == "/v1" and info["software"]["name"] == "Paphos"


def test_generate_exact_keys_and_greedy(http):
    body = {"prompt": "The capital of France is", "max_length": 6, "temperature": 0, "bypass_eos": True, "n": 1}
    first = http.post("/api/v1/generate", json=body)
    assert first.status_code == 200
    results = first.json()["results"]
    assert list(first.json()) == ["results"] and len(results) == 1
    assert set(results[0]) == {"text", "finish_reason", "prompt_tokens", "completion_tokens"}
    assert results[0]["finish_reason"] == "length" and results[0]["completion_tokens"] == 6
    assert results[0]["text"] and http.post("/api/latest/generate", json=body).json() == first.json()
    # The same engine path as /v1/completions: identical greedy text.
    openai = http.post("/v1/completions", json={"prompt": body["prompt"], "max_tokens": 6, "temperature": 0,
                                                "ignore_eos": True}).json()
    assert openai["choices"][0]["text"] == results[0]["text"]
    assert openai["usage"]["prompt_tokens"] == results[0]["prompt_tokens"]


def test_generate_n_and_stop_sequence(http):
    r = http.post("/api/v1/generate", json={"prompt": "1, 2, 3, 4,", "max_length": 12, "temperature": 0.7, "n": 2,
                                            "sampler_seed": 1, "stop_sequence": [","]})
    results = r.json()["results"]
    assert len(results) == 2
    for result in results:
        assert result["finish_reason"] in ("stop", "length")
        if result["finish_reason"] == "stop":
            assert "," not in result["text"]  # trim_stop defaults to true
    kept = http.post("/api/v1/generate", json={"prompt": "1, 2, 3, 4,", "max_length": 12, "temperature": 0,
                                               "stop_sequence": [","], "trim_stop": False}).json()["results"][0]
    assert kept["finish_reason"] == "stop" and kept["text"].endswith(",")


def test_generate_errors(http):
    r = http.post("/api/v1/generate", json={"prompt": "hi", "max_length": 300, "max_context_length": 100})
    assert r.status_code == 400
    body = r.json()
    assert body["message"] == "max_length must not be larger than max_context_length"
    assert body["detail"] == {"msg": body["message"], "type": "BadRequestError"}
    assert body["error"]["code"] == 400 and body["param"] == "max_length"


def test_stream_framing(http):
    body = {"prompt": "Once upon a time", "max_length": 5, "temperature": 0, "bypass_eos": True}
    with http.stream("POST", "/api/extra/generate/stream", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache" and r.headers["connection"] == "keep-alive"
        events = kobold_events(r.read().decode())
    assert events[-1] == {"token": "", "finish_reason": "length"}
    assert all(set(e) == {"token"} and e["token"] for e in events[:-1])
    text = "".join(e["token"] for e in events)
    assert text == http.post("/api/v1/generate", json=body).json()["results"][0]["text"]


def test_token_routes(http):
    count = http.post("/api/extra/tokencount", json={"prompt": "Hello world"})
    assert count.status_code == 200 and list(count.json()) == ["value", "ids"]
    ids = count.json()["ids"]
    assert count.json()["value"] == len(ids) == 2  # no special tokens
    assert http.post("/api/extra/tokenize", json={"prompt": "Hello world"}).json() == {"result": ids, "ids": ids,
                                                                                      "value": 2}
    assert http.post("/api/extra/detokenize", json={"ids": ids}).json() == {"result": "Hello world", "success": True}
    bad = http.post("/api/extra/tokencount", json={"text": "wrong field"})
    assert bad.status_code == 400 and bad.json()["value"] == -1 and "msg" in bad.json()["detail"]
    v1 = http.post("/v1/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert v1["tokens"] == ids


def test_logprobs_round_trip(http):
    r = http.post("/api/v1/generate", json={"prompt": "Hi", "max_length": 3, "temperature": 0, "logprobs": True,
                                            "genkey": "LPKEY", "bypass_eos": True})
    content = r.json()["results"][0]["logprobs"]["content"]
    assert len(content) == 3 and all({"token", "logprob", "top_logprobs"} <= set(c) for c in content)
    assert "".join(c["token"] for c in content) == r.json()["results"][0]["text"]
    assert http.post("/api/extra/last_logprobs", json={"genkey": "LPKEY"}).json() == {"logprobs": {"content": content}}
    # check and abort by genkey, exact shapes (the generation is over: abort has nothing to stop).
    text = r.json()["results"][0]["text"]
    assert http.post("/api/extra/generate/check", json={"genkey": "LPKEY"}).json() == {"results": [{"text": text}]}
    assert http.get("/api/extra/generate/check", params={"genkey": "LPKEY"}).json() == {"results": [{"text": text}]}
    abort = http.post("/api/extra/abort", json={"genkey": "LPKEY"})
    assert abort.status_code == 200 and abort.json() == {"success": False}


# ---- the koboldapi client ----------------------------------------------------------------------


def _kobold_api_class():
    """koboldapi's core client. Its package __init__ also imports image/document extras (rawpy,
    pillow-heif, extractous); where those are not installed, load the core module by itself."""
    try:
        return importlib.import_module("koboldapi").KoboldAPI
    except ImportError:
        pass
    spec = importlib.util.find_spec("koboldapi")
    if spec is None or not spec.submodule_search_locations:
        # `make install` installs it (Makefile); a missing client must not pass as a skipped test.
        pytest.fail("koboldapi is not installed: run `make install` (pip install --no-deps koboldapi==0.5.4)")
    path = Path(next(iter(spec.submodule_search_locations))) / "core" / "api.py"
    module_spec = importlib.util.spec_from_file_location("koboldapi_core_api", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.KoboldAPI


def test_koboldapi_client(http, spawned_server):
    api = _kobold_api_class()(spawned_server)  # its defaults: temp 0, top_k 0, top_p 1, rep_pen 1, min_p 0.05
    assert api.get_model() == f"aphrodite/{NAME}"
    assert api.get_version()["result"] == "KoboldCpp"
    assert api.get_max_context_length() == 2048
    text = api.generate("The capital of France is", max_length=5)
    assert isinstance(text, str) and text
    streamed = api.generate_sync("The capital of France is", max_length=5)
    assert streamed == text  # greedy: the stream spells the same text
    count = api.count_tokens("Hello world")
    assert count["count"] == 2 and api.tokenize("Hello world") == count["tokens"]
    assert api.detokenize(count["tokens"]) == "Hello world"
    assert api.get_performance_stats()["total_gens"] >= 2
    assert api.get_last_logprobs() == {"content": []}  # it asked for none

    # check and abort while a long generation runs under the client's genkey.
    done = {}
    worker = threading.Thread(target=lambda: done.setdefault("text", api.generate("Count: 1, 2, 3,", max_length=400)))
    worker.start()
    deadline = time.monotonic() + 60
    # Until the new generation has text, check still reports the previous one of this genkey.
    while api.check_generation() in (None, "", text):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert api.abort_generation() is True
    worker.join(60)
    assert not worker.is_alive() and done["text"].startswith(api.check_generation() or "")
    assert api.abort_generation() is False


# ---- metrics and abort ------------------------------------------------------------------------


def test_metrics_move_by_exact_amounts(http):
    before = wait_idle(http)
    prompt = "The quick brown fox"
    prompt_tokens = http.post("/api/extra/tokencount", json={"prompt": prompt}).json()["value"]
    r = http.post("/api/v1/generate", json={"prompt": prompt, "max_length": 5, "bypass_eos": True, "n": 2,
                                            "temperature": 0.8})
    assert [x["completion_tokens"] for x in r.json()["results"]] == [5, 5]
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True})
    assert r.json()["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                                 "total_tokens": prompt_tokens + 3}
    after = wait_idle(http)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("aphrodite:prompt_tokens_total") == 2 * prompt_tokens
    assert delta("aphrodite:generation_tokens_total") == 2 * 5 + 3
    assert delta("aphrodite:request_success_total", finished_reason="length") == 3
    assert delta("aphrodite:request_success_total", finished_reason="stop") == 0
    assert delta("aphrodite:e2e_request_latency_seconds_count") == 2
    assert delta("aphrodite:time_to_first_token_seconds_count") == 2
    assert delta("aphrodite:request_queue_time_seconds_count") == 2
    assert delta("aphrodite:request_prompt_tokens_sum") == 2 * prompt_tokens
    assert delta("aphrodite:request_generation_tokens_sum") == 13
    assert delta("aphrodite:request_params_n_sum") == 3
    assert delta("aphrodite:inter_token_latency_seconds_count") == (5 - 1) + (3 - 1)
    assert delta("aphrodite:prefix_cache_queries_total") >= prompt_tokens
    assert metric(after, "aphrodite:kv_cache_usage_perc") == 0
    assert metric(after, "aphrodite:gpu_cache_usage_perc") == 0
    assert metric(after, "paphos:kv_cache_used_blocks") == 0
    assert metric(after, "aphrodite:num_requests_swapped") == 0
    assert metric(after, "paphos:engine_ready") == 1
    info = [k for k in after if k[0] == "aphrodite:cache_config_info"]
    assert len(info) == 1 and dict(info[0][1])["block_size"] == "16"
    assert ("process_resident_memory_bytes", ()) in after


def test_abort_by_genkey_stops_within_one_step_and_frees_blocks(http, spawned_server):
    wait_idle(http)
    result = {}
    body = {"prompt": "Count: 1, 2, 3,", "max_length": 1000, "bypass_eos": True, "temperature": 0, "genkey": "ABORTME"}
    url = f"{spawned_server}/api/v1/generate"
    worker = threading.Thread(target=lambda: result.setdefault("r", httpx.post(url, json=body, timeout=120)))
    worker.start()
    wait_running(http)
    deadline = time.monotonic() + 60
    while len(http.post("/api/extra/generate/check", json={"genkey": "ABORTME"}).json()["results"][0]["text"]) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    m = metrics(http)
    assert metric(m, "aphrodite:kv_cache_usage_perc") > 0 and metric(m, "aphrodite:num_requests_running") == 1
    assert http.post("/api/extra/abort", json={"genkey": "ABORTME"}).json() == {"success": True}
    at_abort = metric(metrics(http), "aphrodite:generation_tokens_total")
    worker.join(60)
    out = result["r"].json()["results"][0]
    assert out["finish_reason"] == "abort" and 0 < out["completion_tokens"] < 1000
    after = wait_idle(http, timeout=5)
    # The engine saw the abort before its next step: at most the step already running finished.
    assert metric(after, "aphrodite:generation_tokens_total") - at_abort <= 1
    assert metric(after, "aphrodite:kv_cache_usage_perc") == 0 and metric(after, "paphos:kv_cache_used_blocks") == 0
    assert http.get("/api/extra/perf").json()["idle"] == 1


def test_bodiless_abort_of_a_stream_frees_blocks(http, spawned_server):
    wait_idle(http)
    events: list[dict] = []
    body = {"prompt": "Count: 1, 2, 3,", "max_length": 1000, "bypass_eos": True, "temperature": 0}

    def run():  # its own connection: httpx clients are not shared across threads here
        with httpx.stream("POST", f"{spawned_server}/api/extra/generate/stream", json=body, timeout=120) as r:
            events.extend(kobold_events(r.read().decode()))

    worker = threading.Thread(target=run)
    worker.start()
    wait_running(http)  # before that, a bodiless check reads the caller's previous generation
    deadline = time.monotonic() + 60
    while not http.post("/api/extra/generate/check").json()["results"][0]["text"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert http.post("/api/extra/abort").json() == {"success": True}  # SillyTavern: no body
    worker.join(60)
    assert events[-1] == {"token": "", "finish_reason": "abort"}
    after = wait_idle(http, timeout=5)
    assert metric(after, "aphrodite:kv_cache_usage_perc") == 0
