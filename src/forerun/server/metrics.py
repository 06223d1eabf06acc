"""Prometheus metrics of one server, in a registry of its own (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ROUTES = (
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/detokenize",
)
"""Metric labels are these (or 'other'), never a raw path a client chose."""


class Metrics:
    """Prometheus metrics in a registry of this app's own (no process-global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("forerun_requests", "HTTP requests", ["endpoint", "status"], registry=self.registry)
        self.tokens = Counter("forerun_generated_tokens", "New tokens generated", ["method"], registry=self.registry)
        self.latency = Histogram(
            "forerun_request_seconds",
            "Generation latency",
            ["endpoint"],
            registry=self.registry,
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120, 300),
        )
        self.tokens_per_forward = Histogram(
            "forerun_tokens_per_forward",
            "Tokens per forward per request",
            ["method"],
            buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8),
            registry=self.registry,
        )
        self.acceptance = Histogram(
            "forerun_acceptance",
            "Accepted / proposed draft tokens per request",
            ["method"],
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0),
            registry=self.registry,
        )
        self.queue = Gauge(
            "forerun_queue_length",
            "Generations waiting or running (a request's sampled choices each count)",
            registry=self.registry,
        )
        self.rejected = Counter("forerun_rejected", "Requests refused with 429 (queue full)", registry=self.registry)

    def count(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ROUTES else "other", str(status)).inc()

    def observe(self, path: str, method: str, stats, seconds: float) -> None:
        """One answered generation: its latency, tokens, tokens per forward and acceptance."""
        self.latency.labels(path if path in ROUTES else "other").observe(seconds)
        self.tokens.labels(method).inc(stats.new_tokens)
        self.tokens_per_forward.labels(method).observe(stats.tokens_per_forward)
        if stats.candidates:
            self.acceptance.labels(method).observe(stats.acceptance_rate)
