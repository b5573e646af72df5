"""Prometheus metrics. Engine figures (requests running / waiting, KV usage, token and preemption
totals) are read from `AsyncEngine.stats()` at scrape time, so they can never drift from the
engine; latencies are histograms the routes observe. Each app has its own registry, so several
servers can live in one process (tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector:
    def __init__(self, engine):
        self._engine = engine

    def collect(self):
        s = self._engine.stats()
        for name, doc, value in (
            ("paxpage_num_requests_running", "Sequences in the running batch.", s.num_running),
            ("paxpage_num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            ("paxpage_kv_cache_usage_perc", "Fraction of KV-cache pages in use (0-1).", s.kv_cache_usage),
            ("paxpage_engine_alive", "1 while the engine loop runs.", float(s.alive)),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("paxpage_prompt_tokens", "Prompt tokens submitted.", s.prompt_tokens),
            ("paxpage_generation_tokens", "Tokens generated.", s.generation_tokens),
            ("paxpage_num_preemptions", "Sequences preempted for lack of KV pages.", s.num_preemptions),
            ("paxpage_engine_steps", "Engine steps run.", s.num_steps),
            ("paxpage_engine_restarts", "Engine rebuilds after a failed step.", s.num_restarts),
            ("paxpage_requests_received", "Engine requests accepted (one per prompt).", s.num_received),
            ("paxpage_requests_finished", "Engine requests that ran to their end.", s.num_finished),
            ("paxpage_requests_aborted", "Engine requests aborted (client gone, cancelled).", s.num_aborted),
            ("paxpage_requests_failed", "Engine requests ended by a failed step or shutdown.", s.num_failed),
        ):
            yield CounterMetricFamily(name, doc, value=value)  # exposed with a _total suffix


class ServerMetrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("paxpage_time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("paxpage_time_per_output_token_seconds",
                              "Time per output token after the first.", buckets=_TPOT_BUCKETS,
                              registry=self.registry)
        self.e2e = Histogram("paxpage_e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             buckets=_TTFT_BUCKETS, registry=self.registry)

    def observe(self, arrival: float, first_token: float | None, finished: float | None,
                num_tokens: int) -> None:
        """Times in one clock; num_tokens: the longest sample's length."""
        if first_token is None:
            return
        self.ttft.observe(max(0.0, first_token - arrival))
        if finished is not None:
            self.e2e.observe(max(0.0, finished - arrival))
            if num_tokens > 1:
                self.tpot.observe(max(0.0, finished - first_token) / (num_tokens - 1))

    def observe_output(self, output) -> None:
        m = getattr(output, "metrics", None)
        if m is None:
            return
        self.observe(m.arrival_time, m.first_token_time, m.finished_time,
                     max((len(c.token_ids) for c in output.outputs), default=0))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
