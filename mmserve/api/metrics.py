"""Prometheus exporter (vLLM's names, `mmserve:` prefix, per-app registry): a `StatLogger` feeds latency and
token metrics; scheduler gauges/counters are read at scrape time, so they are current even when idle.

Per service class (label `service_class`: interactive | batch, the class a request was served in): TTFT and
TPOT histograms, SLO attainment per target kind, good requests (goodput), preemptions, throttled batch decodes."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mmserve.engine.messages import CoreLoopStats, EngineCoreOutputs, EngineInfo
from mmserve.engine.output_processor import RequestMetrics, RequestOutput
from mmserve.request import ServiceClass
from mmserve.scheduler.scheduler import SchedulerStats

P = "mmserve:"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


class _StatsCollector(Collector):
    def __init__(
        self, stats: Callable[[], SchedulerStats], model: str, loop: Callable[[], CoreLoopStats | None]
    ) -> None:
        self.stats, self.model, self.loop = stats, model, loop

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

        def counters_by(name: str, doc: str, label: str, values: dict[str, float]) -> CounterMetricFamily:
            c = CounterMetricFamily(P + name, doc, labels=[*labels, label])
            for value_label, value in values.items():
                c.add_metric([self.model, value_label], value)
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
        yield counter("encoder_tokens_loaded", "Embedding tokens loaded from an encoder instance's output "
                      "(--ec-transfer-config) instead of computed.", s.num_encoder_tokens_loaded)  # fmt: skip
        yield counter("encoder_slices", "Slices of the vision tower's blocks run for temporal groups whose encode "
                      "was spread over several steps to keep within --max-step-ms.", s.num_encoder_slices)  # fmt: skip
        yield gauge("encoder_partial_groups", "Temporal groups part-way through the vision tower.",
                    s.num_partial_encodes)  # fmt: skip
        yield counters_by("num_preemptions_by_class", "Preemptions by recompute, by the preempted request's class.",
                          "service_class", {"interactive": s.num_preemptions_interactive,
                                            "batch": s.num_preemptions_batch})  # fmt: skip
        yield counter("throttled_batch_decodes", "Steps a running batch decode was skipped to protect "
                      "interactive latency (slo policy).", s.num_throttled_batch_decodes)  # fmt: skip
        yield counter("downgraded_requests", "Interactive requests admission control ran as batch "
                      "(slo policy).", s.num_downgraded_requests)  # fmt: skip
        yield counter("rejected_requests", "Interactive requests admission control refused with 429 "
                      "(slo policy, --slo-admission reject).", s.num_rejected_requests)  # fmt: skip
        # Prefill/decode disaggregation (--kv-transfer-config): reads into this instance, leases out of it.
        yield gauge("kv_transfer_loading_requests", "Requests whose prompt KV is being read from a prefill "
                    "instance (also counted as waiting).", s.num_loading_remote_kv)  # fmt: skip
        yield counters_by("kv_transfer_loads", "Reads of a prefill instance's KV blocks that ended, by outcome.",
                          "outcome", {"done": s.num_kv_loads_done, "failed": s.num_kv_loads_failed})
        yield gauge("kv_transfer_leases", "Finished requests whose KV blocks wait for a decode instance "
                    "to read them.", s.num_kv_leases)  # fmt: skip
        yield counter("kv_transfer_blocks_read", "KV blocks read from prefill instances (each: every layer's "
                      "K and V).", s.num_kv_blocks_read)  # fmt: skip
        yield counter("kv_transfer_read_seconds", "Wall seconds of those reads, from posting each to its "
                      "completion, summed.", s.kv_read_s)  # fmt: skip
        yield counter("kv_transfer_leases_expired", "Leases that ended before any decode instance read "
                      "their blocks (the blocks were freed).", s.num_kv_leases_expired)  # fmt: skip
        st = s.step_time
        if st is not None:  # the online step-time model that sizes every step (scheduler/step_time.py)
            yield counter("step_time_observed_seconds", "Measured wall time of the steps the step-time "
                          "model was told about.", st.observed_s)  # fmt: skip
            yield counter("step_time_predicted_seconds", "What the step-time model predicted for those "
                          "steps when they were planned.", st.predicted_s)  # fmt: skip
            yield counter("step_time_abs_error_seconds", "Sum of |observed - predicted| step time.",
                          st.abs_error_s)  # fmt: skip
            yield counter("step_time_observations", "Steps the step-time model was fitted on.", st.num_observed)
            yield gauge("step_time_error_factor", "The planning margin: a high quantile of observed / "
                        "predicted step time over recent steps (>= 1); time targets are divided by it.",
                        st.error_factor)  # fmt: skip
        loop = self.loop()
        if loop is not None:  # the engine core runs in its own process
            parts = CounterMetricFamily(P + "engine_core_loop_seconds", "Wall time of the engine-core "
                                        "process's loop: step (the model and the scheduler), io (messages "
                                        "in and out), idle.", labels=[*labels, "part"])  # fmt: skip
            for part, value in (("step", loop.step_s), ("io", loop.io_s), ("idle", loop.idle_s)):
                parts.add_metric([self.model, part], value)
            yield parts
            yield counter("engine_core_steps", "Steps the engine-core process published.", loop.num_steps)
            yield counter("engine_core_bytes_out", "Bytes the engine core sent to the front ends.", loop.bytes_out)


class _EngineInfoCollector(Collector):
    """What the engine was started with and the memory it holds: fixed at start, exported at every scrape."""

    def __init__(self, info: EngineInfo, model: str) -> None:
        self.info, self.model = info, model

    def collect(self) -> Iterator[Metric]:
        i, labels = self.info, ["model_name"]
        config = GaugeMetricFamily(P + "engine_config_info", "The engine's compute and KV cache dtypes and "
                                   "attention backend (value 1).", labels=[*labels, "dtype", "kv_cache_dtype",
                                   "attention_backend", "block_size"])  # fmt: skip
        config.add_metric([self.model, i.dtype, i.kv_cache_dtype, i.attention_backend, str(i.block_size)], 1.0)
        yield config
        for name, doc, value in (
            ("kv_cache_bytes", "Bytes of the KV cache pool (per tensor-parallel rank).", i.kv_cache_bytes),
            ("kv_cache_bytes_per_token", "KV cache bytes one token takes, all layers, K and V (per rank).",
             i.kv_bytes_per_token),
            ("kv_cache_tokens", "Tokens the KV cache pool holds.", i.num_kv_tokens),
            ("weight_bytes", "Bytes of the model weights held (per rank), quantized ones as stored.", i.weight_bytes),
        ):  # fmt: skip
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            g.add_metric([self.model], value)
            yield g


class _VllmNamesCollector(Collector):
    """The scheduler's gauges under vLLM's own names and labels (`model_name`, `engine`), for what reads them:
    the Gateway API Inference Extension's endpoint picker, llm-d's scorers, autoscalers. Same values as the
    `mmserve:` ones."""

    def __init__(self, stats: Callable[[], SchedulerStats], model: str, cache_config: dict[str, str]) -> None:
        self.stats, self.model, self.cache_config = stats, model, cache_config

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        labels, values = ["model_name", "engine"], [self.model, "0"]
        for name, doc, value in (
            ("num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
        ):
            g = GaugeMetricFamily("vllm:" + name, doc, labels=labels)
            g.add_metric(values, value)
            yield g
        for name, doc, value in (
            ("num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions),
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             s.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_cache_hits),
        ):  # fmt: skip
            c = CounterMetricFamily("vllm:" + name, doc, labels=labels)
            c.add_metric(values, value)
            yield c
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(self.cache_config))  # fmt: skip
        info.add_metric(list(self.cache_config.values()), 1.0)
        yield info


class MetricsExporter:
    """One per app. Implements the engine's `StatLogger` protocol.

    `vllm_cache_config`: also export the scheduler gauges under vLLM's names, with these labels on
    `vllm:cache_config_info` (None: mmserve's names only). `info`: the engine's start-up facts (dtypes, KV
    bytes per token, weight bytes), exported as gauges."""

    def __init__(
        self,
        stats: Callable[[], SchedulerStats],
        model: str,
        vllm_cache_config: dict[str, str] | None = None,
        info: EngineInfo | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        r, lbl = self.registry, ["model_name"]
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token.", lbl,
                              registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between output updates.", lbl,
                             registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to finish.", lbl,
                             registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        cls = [*lbl, "service_class"]
        self.class_ttft = Histogram(P + "time_to_first_token_by_class_seconds", "Arrival to first token, by class.",
                                    cls, registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Per finished request with >= 2 tokens: "
                              "(finish - first token) / (tokens - 1), by class.", cls, registry=r,
                              buckets=_LATENCY_BUCKETS)  # fmt: skip
        # One count per finished request and target kind it has (its own SLO over its class's defaults).
        # TBT is judged by the request's TPOT, as vLLM's goodput does.
        self.slo_attainment = Counter(P + "slo_attainment", "Finished requests by target kind and whether "
                                      "they met it.", [*cls, "slo", "outcome"], registry=r)  # fmt: skip
        self.good_requests = Counter(P + "good_requests", "Finished requests that met every target they had "
                                     "(goodput, vLLM's definition; rate() is req/s).", cls, registry=r)  # fmt: skip
        self.finished_by_class = Counter(P + "finished_requests_by_class", "Requests that finished (stop or "
                                         "length), by class.", cls, registry=r)  # fmt: skip
        self.queue = Histogram(P + "request_queue_time_seconds", "Arrival to first scheduling.", lbl,
                               registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.preprocess = Histogram(P + "request_preprocess_time_seconds", "Arrival to the engine core: media "
                                    "fetch, decode and preprocessing, templating, tokenizing.", lbl,
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
            "Time the vision encoder ran (each step's own encoder time, counted once).",
            lbl,
            registry=r,
        )
        self.media_items = Counter(P + "media_items", "Media items in chat requests.", [*lbl, "media_type"],
                                   registry=r)  # fmt: skip
        self.uploads = Counter(P + "media_uploads", "Upload attempts by outcome.", [*lbl, "media_type", "status"],
                               registry=r)  # fmt: skip
        self._loop: CoreLoopStats | None = None  # the engine-core process's loop times, as last reported
        # The scheduler's figures come from the one engine core, so every API process reports them whole;
        # the request metrics are per process and, with several API processes (prometheus-client's
        # multiprocess mode: PROMETHEUS_MULTIPROC_DIR), summed over all of them at scrape time.
        self._scrape = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self._scrape = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._scrape)
        self._scrape.register(_StatsCollector(stats, model, lambda: self._loop))
        if vllm_cache_config is not None:
            self._scrape.register(_VllmNamesCollector(stats, model, vllm_cache_config))
        if info is not None:
            self._scrape.register(_EngineInfoCollector(info, model))
        self._last_token_time: dict[str, float] = {}  # request id -> time of its previous update
        # The two series every token updates, resolved once (`labels()` looks its child up under a lock).
        self._generation_tokens = self.generation_tokens.labels(model)
        self._itl = self.itl.labels(model)
        self._lock = threading.Lock()

    # -- StatLogger ------------------------------------------------------------------------------------
    def on_output(self, output: RequestOutput, now: float) -> None:
        m = output.metrics
        with self._lock:
            previous = self._last_token_time.get(output.request_id)
            if output.new_token_ids:
                self._generation_tokens.inc(len(output.new_token_ids))
                if previous is not None:
                    self._itl.observe(now - previous)
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
            if m.preprocess_time is not None:
                self.preprocess.labels(self.model).observe(m.preprocess_time)
            if output.finish_reason in ("stop", "length"):  # aborted requests are not judged
                self._observe_class(output, m, now)

    def _observe_class(self, output: RequestOutput, m: RequestMetrics, now: float) -> None:
        """Per-class latency and SLO attainment of one finished request."""
        name = "interactive" if output.service_class == ServiceClass.INTERACTIVE else "batch"
        self.finished_by_class.labels(self.model, name).inc()
        if m.first_token_time is None:
            return
        ttft = m.first_token_time - m.arrival_time
        finish = m.finish_time or now
        self.class_ttft.labels(self.model, name).observe(ttft)
        n = len(output.token_ids)
        tpot = (finish - m.first_token_time) / (n - 1) if n >= 2 else 0.0  # one token: 0, as in vLLM
        if n >= 2:
            self.tpot.labels(self.model, name).observe(tpot)
        slo = output.slo
        checks = {
            "ttft": (slo.ttft_ms, ttft),
            "tbt": (slo.tbt_ms, tpot),
            "deadline": (slo.deadline_ms, finish - m.arrival_time),
        }
        good = True
        for kind, (target_ms, value_s) in checks.items():
            if target_ms is None:
                continue
            met = value_s * 1e3 <= target_ms
            good &= met
            self.slo_attainment.labels(self.model, name, kind, "met" if met else "missed").inc()
        if good:
            self.good_requests.labels(self.model, name).inc()

    def on_step(self, outputs: EngineCoreOutputs) -> None:
        step = outputs.step
        if step is not None and step.encoder_duration_s > 0:
            self.encoder_seconds.labels(self.model).inc(step.encoder_duration_s)
        if outputs.loop is not None:
            self._loop = outputs.loop

    # -- API side --------------------------------------------------------------------------------------
    def count_media(self, counts: dict[str, int]) -> None:
        for kind, n in counts.items():
            if n:
                self.media_items.labels(self.model, kind).inc(n)

    def count_upload(self, kind: str, status: str) -> None:
        self.uploads.labels(self.model, kind, status).inc()

    def render(self) -> bytes:
        return generate_latest(self._scrape)
