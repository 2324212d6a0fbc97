"""Prometheus metrics of one server (its own registry, so several servers can share a
process, as in the tests)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "speedkv_time_to_first_token_seconds",
            "From a request's arrival to its first new token (queueing and prefill).",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "speedkv_time_per_output_token_seconds",
            "Mean time per new token after the first, per finished sequence.",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.kv_bytes = Gauge(
            "speedkv_kv_cache_bytes", "KV cache bytes held by running sequences.", registry=r
        )
        self.running = Gauge(
            "speedkv_requests_running", "Sequences in the decode batch.", registry=r
        )
        self.waiting = Gauge(
            "speedkv_requests_waiting", "Sequences queued for a batch slot.", registry=r
        )
        self.generated = Counter("speedkv_generation_tokens", "New tokens generated.", registry=r)
        self.prompt_tokens = Counter(
            "speedkv_prompt_tokens", "Prompt tokens prefilled.", registry=r
        )
        self.finished = Counter(
            "speedkv_sequences_finished",
            "Sequences that left the server, by reason.",
            ["reason"],  # stop, length, cancelled, error
            registry=r,
        )
        self.rejected = Counter(
            "speedkv_requests_rejected",
            "Requests answered 429 because the queue was full.",
            registry=r,
        )
        self.batch_size = Histogram(
            "speedkv_decode_batch_size",
            "Sequences per decode step.",
            buckets=BATCH_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
