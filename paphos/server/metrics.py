"""GET /metrics (Prometheus text) and the periodic stats log line: the server's operator view.

Two sources feed it. The engine's live state (running / waiting requests, KV use, prefix cache,
preemptions, token counters) is read when Prometheus scrapes (a custom collector over
`engine.stats()`), so the step loop pays nothing per step. Per-request numbers (TTFT, inter-token
latency, end to end, queue time, sizes, finish reasons) arrive once per finished or aborted request
as `RequestStats` from the async engine, on the event loop, and go into histograms and counters.
Names keep Aphrodite's `aphrodite:` prefix so existing dashboards work (contract §3.7); every series
carries `model_name` (the first served name). `paphos:` names are our additions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from paphos.engine.async_engine import RequestStats
    from paphos.server.state import EngineClient

logger = logging.getLogger("paphos.server")
router = APIRouter()

_LABELS = ["model_name"]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
# 1, 2, 5, 10, ... 2M tokens: covers every context length in use.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))


class EngineCollector:
    """Scrape-time series from `engine.stats()` and `engine.cache_config_info()`."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        values = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(values, value)
            return family

        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        yield gauge("aphrodite:num_requests_running", "Sequences in the running batch.", stats["num_running"])
        yield gauge("aphrodite:num_requests_waiting", "Sequences waiting to be scheduled.", stats["num_waiting"])
        yield gauge("aphrodite:num_requests_swapped", "Sequences swapped to CPU (always 0: preemption recomputes).", 0)
        yield gauge("aphrodite:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", stats["kv_usage"])
        yield gauge("aphrodite:gpu_cache_usage_perc", "Alias of kv_cache_usage_perc.", stats["kv_usage"])
        yield gauge("aphrodite:gpu_prefix_cache_hit_rate", "Prefix cache hits / queries in tokens, since start.",
                    hits / queries if queries else 0.0)
        yield counter("aphrodite:num_preemptions", "Preemptions by recompute.", stats.get("num_preemptions", 0))
        yield counter("aphrodite:prefix_cache_queries", "Tokens looked up in the prefix cache.", queries)
        yield counter("aphrodite:prefix_cache_hits", "Tokens served from the prefix cache.", hits)
        yield counter("aphrodite:prompt_tokens", "Prompt tokens prefilled.", stats.get("num_prompt_tokens", 0))
        yield counter("aphrodite:generation_tokens", "Tokens generated.", stats.get("num_generation_tokens", 0))
        yield gauge("paphos:kv_cache_used_blocks", "KV blocks held by requests.", stats["num_used_blocks"])
        yield gauge("paphos:kv_cache_total_blocks", "KV blocks in the cache.", stats.get("num_total_blocks", 0))
        engine = self._engine
        yield gauge("paphos:engine_ready", "1 when the model is loaded and the engine runs.", float(engine.is_ready))
        yield gauge("paphos:engine_errored", "1 after a fatal engine error.", float(engine.errored))
        info = InfoMetricFamily("aphrodite:cache_config", "KV cache configuration.", labels=_LABELS)
        info.add_metric(values, engine.cache_config_info())
        yield info
        lora = engine.lora_info()
        if lora is not None:
            adapters = GaugeMetricFamily(
                "aphrodite:lora_requests_info", "LoRA adapters of the running and waiting requests (comma-separated).",
                labels=[*_LABELS, *lora],
            )
            adapters.add_metric([*values, *lora.values()], 1.0)
            yield adapters


class RequestMetrics:
    """Histograms and counters fed by one RequestStats per finished or aborted request."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=registry).labels(model_name)

        tokens = TOKEN_BUCKETS
        self.ttft = hist("aphrodite:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = hist("aphrodite:inter_token_latency_seconds", "Time between output steps of a request.",
                        ITL_BUCKETS)
        self.tpot = hist("aphrodite:time_per_output_token_seconds", "Alias of inter_token_latency_seconds.",
                         ITL_BUCKETS)
        self.e2e = hist("aphrodite:e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue = hist("aphrodite:request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.prefill = hist("aphrodite:request_prefill_time_seconds", "First scheduled to first token.",
                            LATENCY_BUCKETS)
        self.decode = hist("aphrodite:request_decode_time_seconds", "First token to finish.", LATENCY_BUCKETS)
        self.prompt_tokens = hist("aphrodite:request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation_tokens = hist("aphrodite:request_generation_tokens", "Generated tokens per request.",
                                      tokens)
        self.max_tokens = hist("aphrodite:request_params_max_tokens", "max_tokens per request.", tokens)
        self.params_n = hist("aphrodite:request_params_n", "n per request.", N_BUCKETS)
        self._success = Counter("aphrodite:request_success", "Finished sequences by finish reason.",
                                [*_LABELS, "finished_reason"], registry=registry)
        self._model_name = model_name
        # Pre-create the usual reasons so dashboards see zeros rather than no series.
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)

    def observe(self, stats: RequestStats) -> None:
        self.e2e.observe(stats.finished_time - stats.arrival_time)
        if stats.first_scheduled_time is not None:
            self.queue.observe(stats.first_scheduled_time - stats.arrival_time)
        if stats.first_token_time is not None:
            self.ttft.observe(stats.first_token_time - stats.arrival_time)
            if stats.first_scheduled_time is not None:
                self.prefill.observe(stats.first_token_time - stats.first_scheduled_time)
            self.decode.observe(stats.finished_time - stats.first_token_time)
        for gap in stats.inter_token_latencies:
            self.itl.observe(gap)
            self.tpot.observe(gap)
        self.prompt_tokens.observe(stats.num_prompt_tokens)
        self.generation_tokens.observe(stats.num_generation_tokens)
        if stats.max_tokens is not None:
            self.max_tokens.observe(stats.max_tokens)
        self.params_n.observe(stats.n)
        for reason in stats.finish_reasons:
            self._success.labels(self._model_name, reason).inc()


def build_registry(engine: EngineClient, model_name: str) -> CollectorRegistry:
    """The app's registry: engine state, per-request metrics (observing `engine`), process stats."""
    # No `*_created` twin of every counter and histogram: Aphrodite's dashboards do not use them and
    # they double the scrape (process-wide setting, as vLLM and Aphrodite do).
    disable_created_metrics()
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, model_name))
    engine.add_request_observer(RequestMetrics(registry, model_name).observe)
    ProcessCollector(registry=registry)
    return registry


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def log_stats_forever(engine: EngineClient, interval_s: float) -> None:
    """One line every `interval_s` seconds while there is work: throughput, queue, KV use."""
    last = time.monotonic()
    last_prompt = last_generation = 0.0
    while True:
        await asyncio.sleep(interval_s)
        if not engine.is_ready:
            continue
        stats = engine.stats()
        now = time.monotonic()
        elapsed = max(now - last, 1e-9)
        prompt, generation = stats.get("num_prompt_tokens", 0), stats.get("num_generation_tokens", 0)
        busy = stats["num_running"] or stats["num_waiting"] or prompt != last_prompt or generation != last_generation
        if busy:
            queries = stats.get("prefix_cache_queries", 0)
            hit_rate = stats.get("prefix_cache_hits", 0) / queries if queries else 0.0
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
                "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                (prompt - last_prompt) / elapsed, (generation - last_generation) / elapsed, stats["num_running"],
                stats["num_waiting"], 100 * stats["kv_usage"], 100 * hit_rate,
            )
        last, last_prompt, last_generation = now, prompt, generation
