"""The Prometheus metrics of ``minipaged serve``: vLLM's, named ``minipaged:<vLLM's name>``.

Request-level ones (tokens, finishes, latencies) are observed by the engine client as outputs
arrive; engine-level ones (queues, KV-cache usage, preemptions, prefix cache) are the values of
``EngineClient.stats()``, read under the engine's lock at each scrape and handed to ``exposition``.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries (seconds)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]

ENGINE_GAUGES = (("num_requests_running", "Number of requests currently running."),
                 ("num_requests_waiting", "Number of requests waiting to be processed."),
                 ("num_requests_swapped", "Number of requests swapped to CPU."),
                 ("kv_cache_usage_perc", "KV-cache usage: the fraction of blocks in use (0 to 1)."),
                 ("kv_cache_blocks_used", "KV-cache blocks in use (minipaged only)."),
                 ("kv_cache_blocks_total", "KV-cache blocks (minipaged only)."))
ENGINE_COUNTERS = (("num_preemptions", "Cumulative number of preemptions."),
                   ("prefix_cache_queries", "Prefix-cache queries, in tokens (full blocks looked up)."),
                   ("prefix_cache_hits", "Prefix-cache hits, in tokens (full blocks found)."))
SPEC_DECODE_COUNTERS = (("spec_decode_num_drafts", "Speculative decoding: drafts verified."),
                        ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."),
                        ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."))


class Metrics:
    """vLLM's Prometheus metrics, named ``minipaged:<vLLM's name>``, labelled with ``model_name``.

    Request-level ones are observed as outputs arrive (``first_scheduled``, ``inter_token``,
    ``generated``, ``finished``); engine-level ones (queues, KV-cache usage, preemptions, prefix
    cache) are the values given to ``exposition`` at each scrape.
    """

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no ``_created`` series, as vLLM
        self.model_name = model_name
        self.registry = CollectorRegistry()
        label = ["model_name"]

        def counter(name, doc, extra=()):
            return Counter(f"minipaged:{name}", doc, label + list(extra), registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(f"minipaged:{name}", doc, label, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("request_success", "Count of finished sequences, by finish reason.",
                                       ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent waiting in the queue, in seconds.", REQUEST_BUCKETS)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)
        self.engine_values: dict = {}
        self.registry.register(self)  # collect() below: the engine's values

    # --- observed as outputs arrive

    def first_scheduled(self, queue_time: float, prompt_tokens: int, ttft: float) -> None:
        """A request's first output: its time in the queue, its prompt, its time to first token."""
        name = self.model_name
        self.queue_time.labels(name).observe(queue_time)
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.ttft.labels(name).observe(ttft)

    def inter_token(self, latency: float) -> None:
        self.itl.labels(self.model_name).observe(latency)

    def generated(self, tokens: int) -> None:
        self.generation_tokens.labels(self.model_name).inc(tokens)

    def finished(self, reasons: list[str], latency: float) -> None:
        """An engine request released: one finish per choice (``reasons``), and its end-to-end latency."""
        for reason in reasons:
            self.request_success.labels(self.model_name, reason).inc()
        self.e2e.labels(self.model_name).observe(latency)

    # --- scraped

    def exposition(self, engine_values: dict) -> bytes:
        """Every metric in Prometheus' text format, the engine's ones from ``engine_values``."""
        self.engine_values = engine_values
        return generate_latest(self.registry)

    def describe(self):
        return []

    def collect(self):
        v, name = self.engine_values, [self.model_name]
        if not v:
            return
        for key, doc in ENGINE_GAUGES:
            family = GaugeMetricFamily(f"minipaged:{key}", doc, labels=["model_name"])
            family.add_metric(name, v[key])
            yield family
        for key, doc in ENGINE_COUNTERS + tuple(c for c in SPEC_DECODE_COUNTERS if c[0] in v):  # with drafts only
            counter = CounterMetricFamily(f"minipaged:{key}", doc, labels=["model_name"])
            counter.add_metric(name, v[key])
            yield counter
