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

from speedkv.core.prefix import PrefixCache

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PREFIX_COUNTERS = (  # PrefixCache count, metric, help
    ("hits", "speedkv_prefix_cache_hits", "Prompts that started from a cached prefix."),
    (
        "misses",
        "speedkv_prefix_cache_misses",
        "Prompts under a reusable method that found no cached prefix to start from.",
    ),
    (
        "tokens_reused",
        "speedkv_prefix_cache_reused_tokens",
        "Prompt tokens taken from cached prefixes instead of prefilled.",
    ),
    (
        "evictions",
        "speedkv_prefix_cache_evictions",
        "Cached prefixes dropped to stay within the memory bound.",
    ),
)


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
            "speedkv_prompt_tokens",
            "Prompt tokens of admitted sequences, reused ones included.",
            registry=r,
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
        # the store keeps its own running counts; each counter follows one of them
        self.prefix_counters = {
            count: Counter(name, help_, registry=r) for count, name, help_ in PREFIX_COUNTERS
        }
        self._prefix_seen = dict.fromkeys(self.prefix_counters, 0)  # counts last published
        self.prefix_bytes = Gauge(
            "speedkv_prefix_cache_bytes",
            "Buffer bytes held by cached prefixes (a running sequence's prompt shares its own).",
            registry=r,
        )
        self.prefix_entries = Gauge(
            "speedkv_prefix_cache_entries", "Cached prefixes held.", registry=r
        )

    def publish_prefix_cache(self, store: PrefixCache) -> None:
        """Copy the store's state into the metrics; only the thread that owns the store may
        call this (reading its entries while they change would fail)."""
        for count, counter in self.prefix_counters.items():
            now = getattr(store, count)
            counter.inc(now - self._prefix_seen[count])
            self._prefix_seen[count] = now
        self.prefix_bytes.set(store.bytes())
        self.prefix_entries.set(len(store))

    def render(self) -> bytes:
        return generate_latest(self.registry)
