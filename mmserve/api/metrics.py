"""Prometheus exporter (vLLM's names, `mmserve:` prefix, per-app registry): a `StatLogger` feeds latency and
token metrics; scheduler gauges/counters are read at scrape time, so they are current even when idle."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmserve.engine.core import StepRecord
from mmserve.engine.output_processor import RequestOutput
from mmserve.scheduler.scheduler import SchedulerStats

P = "mmserve:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], SchedulerStats], model: str) -> None:
        self.stats, self.model = stats, model

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        labels = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            g.add_metric([self.model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(P + name, doc, labels=labels)
            c.add_metric([self.model], value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1).", s.kv_cache_usage)
        yield counter("num_preemptions", "Preemptions by recompute.", s.num_preemptions)
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries
        )
        yield counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.", s.prefix_cache_hits)
        queries = s.encoder_cache_hits + s.num_encoder_tokens_computed
        yield counter("mm_cache_queries", "Embedding tokens asked of the encoder cache.", queries)
        yield counter("mm_cache_hits", "Embedding tokens served by the encoder cache.", s.encoder_cache_hits)
        yield counter(
            "encoder_tokens", "Embedding tokens the vision encoder computed.", s.num_encoder_tokens_computed
        )


class MetricsExporter:
    """One per app. Implements the engine's `StatLogger` protocol."""

    def __init__(self, stats: Callable[[], SchedulerStats], model: str) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        r, lbl = self.registry, ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token.", lbl,
                              registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between output updates.", lbl,
                             registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to finish.", lbl,
                             registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.queue = Histogram(P + "request_queue_time_seconds", "Arrival to first scheduling.", lbl,
                               registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.prompt_tokens = Counter(
            P + "prompt_tokens", "Prefill tokens of finished requests.", lbl, registry=r
        )
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", lbl, registry=r)
        self.success = Counter(
            P + "request_success", "Finished requests.", [*lbl, "finished_reason"], registry=r
        )
        self.encoder_seconds = Counter(
            P + "encoder_seconds",
            "Wall time of steps that ran the vision encoder (upper bound).",
            lbl,
            registry=r,
        )
        self.media_items = Counter(P + "media_items", "Media items in chat requests.", [*lbl, "media_type"],
                                   registry=r)  # fmt: skip
        self.uploads = Counter(P + "media_uploads", "Upload attempts by outcome.", [*lbl, "media_type", "status"],
                               registry=r)  # fmt: skip
        self.registry.register(_StatsCollector(stats, model))
        self._last_token_time: dict[str, float] = {}  # request id -> time of its previous update
        self._lock = threading.Lock()

    # -- StatLogger ------------------------------------------------------------------------------------
    def on_output(self, output: RequestOutput, now: float) -> None:
        m = output.metrics
        with self._lock:
            previous = self._last_token_time.get(output.request_id)
            if output.new_token_ids:
                self.generation_tokens.labels(self.model).inc(len(output.new_token_ids))
                if previous is not None:
                    self.itl.labels(self.model).observe(now - previous)
                self._last_token_time[output.request_id] = now
            if not output.finished:
                return
            self._last_token_time.pop(output.request_id, None)
        self.success.labels(self.model, output.finish_reason).inc()
        self.prompt_tokens.labels(self.model).inc(len(output.prompt_token_ids))
        if m is not None:
            self.e2e.labels(self.model).observe((m.finish_time or now) - m.arrival_time)
            if m.first_token_time is not None:
                self.ttft.labels(self.model).observe(m.first_token_time - m.arrival_time)
            if m.scheduled_time is not None:
                self.queue.labels(self.model).observe(m.scheduled_time - m.arrival_time)

    def on_step(self, stats: SchedulerStats, step: StepRecord | None) -> None:
        if step is not None and step.encoder_duration_s > 0:
            self.encoder_seconds.labels(self.model).inc(step.encoder_duration_s)

    # -- API side --------------------------------------------------------------------------------------
    def count_media(self, counts: dict[str, int]) -> None:
        for kind, n in counts.items():
            if n:
                self.media_items.labels(self.model, kind).inc(n)

    def count_upload(self, kind: str, status: str) -> None:
        self.uploads.labels(self.model, kind, status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
