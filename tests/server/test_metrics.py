"""/metrics exposition and per-request observation (fake engine), the stats log line, /health after
a fatal engine error, /.well-known/serviceinfo. (Counters against the real engine: test_spawned_kobold.py.)"""

from __future__ import annotations

import logging
import time

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from paphos.engine.async_engine import RequestStats
from tests.server.fakes import FakeEngine, assert_error_shape, make_app


def _samples(client) -> dict:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def _get(samples, name, **labels):
    return samples[(name, tuple(sorted({"model_name": "fake-model", **labels}.items())))]


def test_metrics_names_and_labels(client):
    samples = _samples(client)
    for name in ("aphrodite:num_requests_running", "aphrodite:num_requests_waiting", "aphrodite:num_requests_swapped",
                 "aphrodite:kv_cache_usage_perc", "aphrodite:gpu_cache_usage_perc",
                 "aphrodite:gpu_prefix_cache_hit_rate", "aphrodite:num_preemptions_total",
                 "aphrodite:prefix_cache_queries_total", "aphrodite:prefix_cache_hits_total",
                 "aphrodite:prompt_tokens_total", "aphrodite:generation_tokens_total", "paphos:engine_ready",
                 "aphrodite:time_to_first_token_seconds_count", "aphrodite:inter_token_latency_seconds_count",
                 "aphrodite:time_per_output_token_seconds_count", "aphrodite:e2e_request_latency_seconds_count",
                 "aphrodite:request_queue_time_seconds_count", "aphrodite:request_prompt_tokens_count",
                 "aphrodite:request_generation_tokens_count", "aphrodite:request_params_n_count"):
        assert _get(samples, name) == (1 if name == "paphos:engine_ready" else 0), name
    assert _get(samples, "aphrodite:cache_config_info", block_size="16") == 1
    for reason in ("stop", "length", "abort"):
        assert _get(samples, "aphrodite:request_success_total", finished_reason=reason) == 0


def test_request_stats_feed_histograms(client, engine):
    (observe,) = engine.observers
    observe(RequestStats(
        request_id="r", arrival_time=10.0, finished_time=12.0, first_scheduled_time=10.25, first_token_time=10.5,
        num_prompt_tokens=7, num_generation_tokens=5, n=2, max_tokens=3, finish_reasons=["stop", "length"],
        inter_token_latencies=[0.5, 0.25],
    ))
    observe(RequestStats(
        request_id="q", arrival_time=0.0, finished_time=1.0, first_scheduled_time=None, first_token_time=None,
        num_prompt_tokens=4, num_generation_tokens=0, n=1, max_tokens=8, finish_reasons=["abort"],
    ))
    s = _samples(client)
    assert _get(s, "aphrodite:time_to_first_token_seconds_count") == 1
    assert _get(s, "aphrodite:time_to_first_token_seconds_sum") == 0.5
    assert _get(s, "aphrodite:time_to_first_token_seconds_bucket", le="0.5") == 1
    assert _get(s, "aphrodite:request_queue_time_seconds_sum") == 0.25
    assert _get(s, "aphrodite:request_prefill_time_seconds_sum") == 0.25
    assert _get(s, "aphrodite:request_decode_time_seconds_sum") == 1.5
    assert _get(s, "aphrodite:e2e_request_latency_seconds_count") == 2
    assert _get(s, "aphrodite:e2e_request_latency_seconds_sum") == 3.0
    assert _get(s, "aphrodite:inter_token_latency_seconds_sum") == 0.75
    assert _get(s, "aphrodite:time_per_output_token_seconds_count") == 2
    assert _get(s, "aphrodite:request_prompt_tokens_sum") == 11
    assert _get(s, "aphrodite:request_generation_tokens_sum") == 5
    assert _get(s, "aphrodite:request_params_n_sum") == 3
    assert _get(s, "aphrodite:request_params_max_tokens_sum") == 11
    for reason, count in (("stop", 1), ("length", 1), ("abort", 1)):
        assert _get(s, "aphrodite:request_success_total", finished_reason=reason) == count


def test_health_503_after_fatal_engine_error(client, engine):
    assert client.get("/health").status_code == 200
    engine.errored, engine.error = True, RuntimeError("CUDA error: device lost")
    body = assert_error_shape(client.get("/health"), 503, "ServiceUnavailableError")
    assert "device lost" in body["message"]
    assert_error_shape(client.get("/v1/models"), 503)
    assert_error_shape(client.post("/api/v1/generate", json={"prompt": "hi"}), 503)
    assert client.get("/metrics").status_code == 200  # still scrapeable
    assert "paphos:engine_errored" in client.get("/metrics").text


def test_serviceinfo(client):
    info = client.get("/.well-known/serviceinfo").json()
    assert info["version"] == 0.2 and info["software"]["name"] == "Paphos"
    assert info["api"]["openai"]["rel_url"] == "/v1" and info["api"]["koboldai"]["rel_url"] == "/api"


class _BusyEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0

    def stats(self):
        self.tokens += 100
        return {"num_running": 2, "num_waiting": 1, "kv_usage": 0.25, "num_used_blocks": 4,
                "num_prompt_tokens": self.tokens, "num_generation_tokens": self.tokens // 2}


def _log_lines(caplog, engine, **config) -> list[str]:
    caplog.set_level(logging.INFO, logger="paphos.server")
    with TestClient(make_app(engine, stats_interval_s=0.02, **config)):
        time.sleep(0.3)
    return [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()]


def test_stats_log_line(caplog):
    lines = _log_lines(caplog, _BusyEngine())
    assert lines and "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%" in lines[-1]
    assert "Avg prompt throughput" in lines[-1] and "tokens/s" in lines[-1]


def test_stats_log_disabled_and_quiet_when_idle(caplog):
    assert _log_lines(caplog, _BusyEngine(), disable_log_stats=True) == []
    assert _log_lines(caplog, FakeEngine()) == []  # an idle server does not repeat itself


def test_max_log_len(caplog, engine):
    caplog.set_level(logging.INFO, logger="paphos.server")
    with TestClient(make_app(engine, disable_log_requests=False, max_log_len=2)) as c:
        c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("request cmpl-"))
    assert line.endswith("prompt_token_ids=[1, 104]")


def test_grafana_dashboard_uses_exposed_series(client):
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parents[2] / "deploy/grafana/paphos-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b((?:aphrodite|paphos):[a-z0-9_]+|process_[a-z_]+)", e)}
    exposed = {s.name for family in text_string_to_metric_families(client.get("/metrics").text) for s in family.samples}
    assert used and used <= exposed, used - exposed
