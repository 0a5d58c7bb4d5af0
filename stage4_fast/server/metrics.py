"""Prometheus figures of the API server (GET /metrics, text format).

The gauges are read from the scheduler's stats at scrape time; each app has its own registry (tests run several).
With ``--api-server-count`` > 1 each process writes files to a launcher-owned directory (prometheus_client's
multiprocess mode) and a scrape sums them all.
"""

from __future__ import annotations

from typing import Any, Dict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the route)

# latencies of a CPU test model and of a GPU serving a real one both land inside these buckets
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# routes counted under their own name; anything else (a fuzzer's random paths) is "other", bounding the label set
KNOWN_ENDPOINTS = frozenset({"/health", "/v1", "/v1/models", "/v1/stats", "/v1/completions", "/v1/chat/completions",
                             "/generate", "/metrics"})


class ServerMetrics:
    def __init__(self, multiprocess: bool = False) -> None:
        """``multiprocess``: $PROMETHEUS_MULTIPROC_DIR was set before prometheus_client was first imported."""
        if multiprocess and values.ValueClass is values.MutexValue:  # (the class of one process's figures)
            raise RuntimeError("prometheus_client was imported before $PROMETHEUS_MULTIPROC_DIR was set")
        self.multiprocess = multiprocess
        # multiprocess: the figures live in the files, not in a registry; a scrape collects them (render)
        self.registry = None if multiprocess else CollectorRegistry()
        r = self.registry

        def gauge(name: str, help: str, mode: str = "mostrecent") -> Gauge:  # mode: see the module docstring
            return Gauge(name, help, registry=r, multiprocess_mode=mode)

        self.requests = Counter("minisgl_http_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("minisgl_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("minisgl_time_to_first_token_seconds", "submit to first reply",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("minisgl_inter_token_latency_seconds", "between two replies of a request",
                             buckets=_ITL_BUCKETS, registry=r)
        self.rejected = Counter("minisgl_rejected_requests", "requests refused because the queue was full", registry=r)
        self.queue = gauge("minisgl_num_queued_requests", "requests waiting for prefill")
        self.running = gauge("minisgl_num_running_requests", "requests decoding")
        # kept current by the FrontendManager, so that a scrape of one process can sum the live ones
        self.inflight = gauge("minisgl_num_inflight_requests", "requests the API servers wait on", "livesum")
        self.kv_total = gauge("minisgl_kv_pages_total", "KV pool pages")
        self.kv_free = gauge("minisgl_kv_pages_free", "KV pages free")
        self.kv_evictable = gauge("minisgl_kv_pages_evictable", "KV pages held only by the prefix cache")
        self.kv_usage = gauge("minisgl_kv_usage_ratio", "1 - (free + evictable) / total")

    def count_request(self, path: str, status: int) -> None:
        self.requests.labels(path if path in KNOWN_ENDPOINTS else "other", str(status)).inc()

    def render(self, stats: Dict[str, Any]) -> bytes:
        total = stats["num_pages"]
        self.queue.set(stats["pending_reqs"])
        self.running.set(stats["running_reqs"])
        self.kv_total.set(total)
        self.kv_free.set(stats["free_pages"])
        self.kv_evictable.set(stats["evictable_pages"])
        self.kv_usage.set(1.0 - (stats["free_pages"] + stats["evictable_pages"]) / total if total else 0.0)
        if not self.multiprocess:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
