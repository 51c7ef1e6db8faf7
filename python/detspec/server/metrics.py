"""Prometheus metrics of the server, with vLLM's names under the ``detspec:`` prefix.

Every app has its own ``CollectorRegistry`` (several apps in one process do not clash).
Request-level series (tokens, latencies, request counts) are recorded by the server as
requests run; engine-wide series (KV usage, verify passes, rollbacks, preemptions) are read
from the engine at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py)
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class _EngineCollector(Collector):
    """Series read at scrape time: queue gauges from the server's counts, KV pool and DVR
    counters from the engine."""

    def __init__(
        self,
        model_name: str,
        queue_counts: Callable[[], tuple[int, int]],
        kv_stats: Callable[[], dict[str, Any]],
        engine_stats: Callable[[], dict[str, Any]],
    ) -> None:
        self._labels = {"model_name": model_name}
        self._queue_counts = queue_counts
        self._kv_stats = kv_stats
        self._engine_stats = engine_stats

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self._labels))
        g.add_metric(list(self._labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self._labels))
        c.add_metric(list(self._labels.values()), value)
        return c

    def collect(self) -> Iterator[Any]:
        running, waiting = self._queue_counts()
        yield self._gauge(
            "detspec:num_requests_running", "Sequences in the engine's running batch.", running
        )
        yield self._gauge(
            "detspec:num_requests_waiting", "Sequences waiting for a batch slot.", waiting
        )
        try:
            kv = self._kv_stats()
            st = self._engine_stats()
        except Exception:  # engine shut down: no engine-side series
            return
        # One page is pinned for the engine's lifetime: "used" here means held by requests.
        pinned = int(kv.get("pinned_pages", 0))
        total = int(kv["total_pages"])
        used = int(kv["used_pages"]) - pinned
        yield self._gauge(
            "detspec:kv_cache_usage_perc",
            "KV-cache usage by requests: 1 means 100 percent.",
            used / max(total - pinned, 1),
        )
        yield self._gauge("detspec:kv_cache_used_pages", "KV pages held by requests.", used)
        yield self._gauge("detspec:kv_cache_free_pages", "Free KV pages.", kv["free_pages"])
        yield self._gauge("detspec:kv_cache_total_pages", "KV pages in the pool.", total)
        yield self._gauge(
            "detspec:kv_cache_pinned_pages", "KV pages reserved by the engine.", pinned
        )
        yield self._gauge(
            "detspec:kv_cache_cached_pages",
            "KV pages kept by the prefix cache.",
            kv["cached_pages"],
        )
        yield self._gauge("detspec:prefix_cache_hit_rate", "Prefix-cache hit rate.", kv["hit_rate"])
        yield self._counter(
            "detspec:num_preemptions", "Cumulative preemptions.", st["num_preemptions"]
        )
        yield self._counter(
            "detspec:verify_passes", "Cumulative DVR verify passes.", st["num_verify_passes"]
        )
        yield self._counter("detspec:rollbacks", "Cumulative DVR rollbacks.", st["num_rollbacks"])
        yield self._counter(
            "detspec:rolled_back_tokens",
            "Cumulative tokens discarded by DVR rollbacks.",
            st["num_rolled_back_tokens"],
        )
        yield self._counter(
            "detspec:padded_verify_rows",
            "Cumulative padded rows in DVR verify passes.",
            st["num_padded_rows"],
        )


class ServerMetrics:
    """The app's metrics, in their own registry."""

    def __init__(
        self,
        model_name: str,
        queue_counts: Callable[[], tuple[int, int]],
        kv_stats: Callable[[], dict[str, Any]],
        engine_stats: Callable[[], dict[str, Any]],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter(
            "detspec:prompt_tokens", "Prefill tokens processed.", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "detspec:generation_tokens", "Generation tokens produced.", labels, registry=r
        ).labels(model_name)
        self._success = Counter(
            "detspec:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.deterministic_requests = Counter(
            "detspec:deterministic_requests",
            "Requests that asked for deterministic output.",
            labels,
            registry=r,
        ).labels(model_name)
        self._http_errors = Counter(
            "detspec:request_errors",
            "Requests answered with an error, by HTTP status.",
            ["model_name", "status"],
            registry=r,
        )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.ttft = histogram(
            "detspec:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "detspec:inter_token_latency_seconds",
            "Time between streamed outputs (per output, divided over its new tokens).",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "detspec:e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS
        )
        self.prompt_len = histogram(
            "detspec:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.gen_len = histogram(
            "detspec:request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        self.verify_passes_per_request = histogram(
            "detspec:request_verify_passes",
            "DVR verify passes per deterministic request.",
            (0, 1, 2, 4, 8, 16, 32, 64, 128),
        )
        r.register(_EngineCollector(model_name, queue_counts, kv_stats, engine_stats))

    def request_finished(self, reason: str | None) -> None:
        self._success.labels(self.model_name, reason or "unknown").inc()

    def error(self, status: int) -> None:
        self._http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
