"""`/metrics` in Prometheus' text format, under vLLM's metric names (the names NVIDIA's AIPerf and most LLM
dashboards scrape), prefixed `vllm:` by default or `tensorsmith:` (`--metrics-prefix`). Beside them: the share
of the engine's slots in use (as vLLM's kv_cache_usage_perc, a fraction) and the backend that runs the model.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from tensorsmith.runtime.engine import EngineStats
from tensorsmith.runtime.token_stream import TokenStream

# vLLM's buckets, in seconds
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class ServeMetrics:
    def __init__(self, model_name: str, backend: str, prefix: str = "vllm:", prefix_caching: bool = False) -> None:
        """`prefix_caching`: whether the engine looks prompts up in its kept prefixes (the counters count then)."""
        disable_created_metrics()  # no `_created` series beside each counter and histogram, as vLLM
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(prefix + name, text, labels, buckets=buckets, registry=self.registry)

        def gauge(name: str, text: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(prefix + name, text, [*labels, *extra], registry=self.registry)

        def counter(name: str, text: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, text, [*labels, *extra], registry=self.registry)

        self.running = gauge("num_requests_running", "Requests decoding in a slot")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a slot")
        self.slot_usage = gauge("kv_cache_usage_perc", "Share of the engine's cache slots in use (1 = all)")
        self.backend = gauge("backend_info", "The backend that runs the model (value 1)", ("backend",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens read")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the slots' kept prefixes")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found there, not read again")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.success = counter("request_success", "Requests answered", ("finished_reason",))
        self.failures = counter("request_failure", "Requests refused or failed, by HTTP status", ("status",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request")
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per token after the first, per request")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token")
        self.queue = histogram("request_queue_time_seconds", "Arrival to a slot")
        self.prompt_lengths = histogram("request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.output_lengths = histogram("request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS)
        self._model = model_name
        self._prefix_caching = prefix_caching
        self.backend.labels(model_name, backend).set(1)

    def finished(self, stream: TokenStream, reason: str) -> None:
        """A request answered: its tokens and timings."""
        model, timings = self._model, stream.timings
        self.prompt_tokens.labels(model).inc(stream.prompt_tokens)
        if self._prefix_caching:
            self.prefix_queries.labels(model).inc(stream.prompt_tokens)
            self.prefix_hits.labels(model).inc(stream.cached_tokens)
        self.generation_tokens.labels(model).inc(stream.completion_tokens)
        self.success.labels(model, reason).inc()
        self.prompt_lengths.labels(model).observe(stream.prompt_tokens)
        self.output_lengths.labels(model).observe(stream.completion_tokens)
        for value, histogram in (
            (timings.time_to_first_token, self.ttft),
            (timings.end_to_end, self.e2e),
            (timings.queue_time, self.queue),
        ):
            if value is not None:
                histogram.labels(model).observe(value)
        latencies = timings.inter_token_latencies
        for latency in latencies:
            self.itl.labels(model).observe(latency)
        if latencies:
            self.tpot.labels(model).observe(sum(latencies) / len(latencies))

    def failed(self, status: int) -> None:
        self.failures.labels(self._model, str(status)).inc()

    def render(self, stats: EngineStats | None) -> bytes:
        """The text format, the engine's gauges read now."""
        if stats is not None:
            self.running.labels(self._model).set(stats.running)
            self.waiting.labels(self._model).set(stats.waiting)
            self.slot_usage.labels(self._model).set(stats.running / stats.slots)
        return bytes(generate_latest(self.registry))
