"""GET /metrics: Prometheus text built on scrape from the engine's live state.

The scheduler's numbers are read when Prometheus asks (a custom collector), so the step loop pays
nothing per step. Names keep Aphrodite's `aphrodite:` prefix so existing dashboards work; every
series carries `model_name` (the first served name). Request-level histograms and counters
(TTFT, ITL, success by finish reason) belong with the KoboldAI/metrics work and are not here yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

router = APIRouter()


class EngineCollector:
    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        labels = ["model_name"]
        values = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("aphrodite:num_requests_running", "Sequences in the running batch.", stats["num_running"])
        yield gauge("aphrodite:num_requests_waiting", "Sequences waiting to be scheduled.", stats["num_waiting"])
        yield gauge("aphrodite:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", stats["kv_usage"])
        yield gauge("aphrodite:gpu_cache_usage_perc", "Alias of kv_cache_usage_perc.", stats["kv_usage"])
        yield gauge("paphos:kv_cache_used_blocks", "KV blocks held by requests.", stats["num_used_blocks"])
        yield counter("aphrodite:num_preemptions", "Preemptions by recompute.", stats.get("num_preemptions", 0))
        yield counter("aphrodite:prefix_cache_queries", "Tokens looked up in the prefix cache.",
                      stats.get("prefix_cache_queries", 0))
        yield counter("aphrodite:prefix_cache_hits", "Tokens served from the prefix cache.",
                      stats.get("prefix_cache_hits", 0))


def build_registry(stats: Callable[[], dict[str, float]], model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineCollector(stats, model_name))
    return registry


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
