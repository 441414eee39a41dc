"""Prometheus metrics of `draftsmith serve` (text format at /metrics), in a registry of their own."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServeMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "draftsmith_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("draftsmith_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.completion_tokens = Counter(
            "draftsmith_completion_tokens", "Generated tokens of served requests", registry=r
        )
        self.tau = Histogram(
            "draftsmith_tau",
            "Acceptance length per request: tokens per target forward",
            buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8),
            registry=r,
        )
        self.acceptance_rate = Histogram(
            "draftsmith_acceptance_rate",
            "Accepted / proposed draft tokens per request",
            buckets=tuple(i / 10 for i in range(11)),
            registry=r,
        )
        self.ttft = Histogram(
            "draftsmith_time_to_first_token_seconds",
            "Request arrival to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "draftsmith_request_latency_seconds",
            "Request arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "draftsmith_queue_wait_seconds",
            "Time a request waited for the engine",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.waiting = Gauge("draftsmith_queue_waiting", "Requests waiting for the engine", registry=r)
        self.running = Gauge("draftsmith_running", "Requests on the engine (0 or 1)", registry=r)

    def observe_result(self, res) -> None:
        self.prompt_tokens.inc(res.prompt_tokens)
        self.completion_tokens.inc(len(res.token_ids))
        if res.accepted:
            self.tau.observe(res.tau)
            if res.proposed_per_round:
                self.acceptance_rate.observe(sum(res.accepted) / (res.proposed_per_round * len(res.accepted)))

    def render(self) -> bytes:
        return generate_latest(self.registry)
