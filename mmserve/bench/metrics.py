"""Serving metrics with `vllm bench serve`'s definitions (TTFT, TPOT, ITL, e2e latency, throughput,
goodput), as pure functions over per-request timings. Knows nothing of transports or the engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserve.bench import num, summary

PERCENTILES = (50.0, 90.0, 99.0)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class RequestTiming:
    """One request as the client saw it; every time is `time.perf_counter()` seconds."""

    start_s: float  # when the request was sent
    chunk_times_s: tuple[float, ...]  # arrival of each non-empty output delta, in order
    end_s: float  # when the response finished (done event / end of stream)
    prompt_tokens: int
    output_tokens: int
    success: bool = True
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else None

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1); None for fewer than two output tokens."""
        ttft = self.ttft_s
        return None if ttft is None or self.output_tokens < 2 else (self.e2el_s - ttft) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive deltas (one delta may carry several tokens, as in vLLM)."""
        return [b - a for a, b in itertools.pairwise(self.chunk_times_s)]


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds); ValueError if malformed."""
    slos: dict[str, float] = {}
    for spec in specs or ():
        name, sep, value = spec.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"goodput: expected NAME:MS with NAME in {GOODPUT_METRICS}, got {spec!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput: {spec!r}: {value!r} is not a number of milliseconds") from None
        if not slos[name] > 0:
            raise ValueError(f"goodput: {spec!r}: the SLO must be positive")
    return slos


def meets_slos(timing: RequestTiming, slos: dict[str, float]) -> bool:
    """A request counts toward goodput only if it succeeded and every given SLO holds (ms, <=).
    TPOT of a one-token request is 0, as in vLLM."""
    if not timing.success or timing.ttft_s is None:
        return False
    values_s = {"ttft": timing.ttft_s, "tpot": timing.tpot_s or 0.0, "e2el": timing.e2el_s}
    return all(values_s[name] * 1e3 <= limit for name, limit in slos.items())


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None where either is missing or b is 0."""
    return a / b if a is not None and b else None


def percentile_ms(values_s: Sequence[float], q: float) -> float | None:
    """The `q`th percentile of `values_s` in milliseconds (numpy's linear interpolation: 50 is the median, 100
    the max); None when there are none."""
    return float(np.percentile(values_s, q)) * 1e3 if len(values_s) else None


def summarize_ms(values_s: Sequence[float], name: str) -> dict:
    """mean / median / std / pXX of `values_s`, in milliseconds, under vLLM's key names; 0 when empty."""
    arr = np.asarray(values_s, dtype=np.float64) * 1e3 if len(values_s) else np.zeros(1)  # none: all 0
    stats = {"mean": arr.mean(), "median": np.median(arr), "std": arr.std()}
    stats |= {f"p{p:g}": np.percentile(arr, p) for p in PERCENTILES}
    return {f"{stat}_{name}_ms": float(value) for stat, value in stats.items()}


def throughput_figures(num_requests: int, input_tokens: int, output_tokens: int, duration_s: float) -> dict:
    """Duration, token totals and request / output / total token throughput, under vLLM's key names."""
    return {"duration_s": duration_s, "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
            "request_throughput": num_requests / duration_s, "output_throughput": output_tokens / duration_s,
            "total_token_throughput": (input_tokens + output_tokens) / duration_s}  # fmt: skip


def compute_metrics(timings: Sequence[RequestTiming], duration_s: float,
                    goodput_slos: dict[str, float] | None = None) -> dict:  # fmt: skip
    """Every figure of one run. Throughputs are over `duration_s` (first send to last finish)."""
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    ok = [t for t in timings if t.success]
    in_tokens, out_tokens = sum(t.prompt_tokens for t in ok), sum(t.output_tokens for t in ok)
    metrics: dict = {"completed": len(ok), "failed": len(timings) - len(ok),
                     **throughput_figures(len(ok), in_tokens, out_tokens, duration_s),
                     "goodput_slos_ms": dict(goodput_slos) if goodput_slos else None,
                     "request_goodput": sum(meets_slos(t, goodput_slos) for t in timings) / duration_s
                     if goodput_slos else None}  # fmt: skip
    samples = {"ttft": [t.ttft_s for t in ok], "tpot": [t.tpot_s for t in ok],
               "itl": [gap for t in ok for gap in t.itls_s], "e2el": [t.e2el_s for t in ok]}  # fmt: skip
    for name, values in samples.items():  # None: no first token (TTFT), fewer than two tokens (TPOT)
        metrics |= summarize_ms([v for v in values if v is not None], name)
    return metrics


def first_vs_repeats_ttft(timings: Sequence[RequestTiming]) -> dict:
    """TTFT of request 0 against the others' (the `prefix` workload sends request 0 alone, so it is the
    cold miss and the others share its cached prefix): median / first as `ttft_repeats_over_first`. None
    where a figure is missing: request 0 failed before its first token, or no other request got one."""
    first, repeats = ([t.ttft_s for t in ts if t.success and t.ttft_s is not None]
                      for ts in (timings[:1], timings[1:]))  # fmt: skip
    first_ms, median = percentile_ms(first, 50.0), percentile_ms(repeats, 50.0)
    return {"ttft_first_ms": first_ms, "ttft_repeats_median_ms": median,
            "ttft_repeats_p90_ms": percentile_ms(repeats, 90.0), "ttft_repeats_over_first": ratio(median, first_ms)}


def video_interference(texts: Sequence[RequestTiming], videos: Sequence[RequestTiming]) -> dict:
    """The `long-video` workload's figures: how the text streams' inter-token latency fared while the
    videos were in the server (`text_itl_in_window_*`), against the rest of the run (`..._out_...`). The
    window runs from the first video's send to the last video's end; a text gap belongs to it when its later
    token arrived inside. None where there is nothing to measure."""
    done = [v for v in videos if v.success]
    window = (min(v.start_s for v in done), max(v.end_s for v in done)) if done else None
    gaps: dict[str, list[float]] = {"in": [], "out": []}
    for t in texts:
        for a, b in itertools.pairwise(t.chunk_times_s if t.success else ()):
            gaps["in" if window is not None and window[0] <= b <= window[1] else "out"].append(b - a)
    ttfts = [v.ttft_s for v in done if v.ttft_s is not None]
    return {"video_window_s": window[1] - window[0] if window is not None else None,
            **{f"text_itl_{where}_window_{stat}_ms": percentile_ms(gaps[where], q) for where in ("in", "out")
               for stat, q in (("p50", 50.0), ("p99", 99.0), ("max", 100.0))},
            "text_itl_in_window_gaps": len(gaps["in"]), "video_ttft_median_ms": percentile_ms(ttfts, 50.0),
            "video_ttft_max_ms": percentile_ms(ttfts, 100.0)}  # fmt: skip


def greedy_agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict[str, float]:
    """Greedy token ids of an engine against a reference engine's on the same prompts: the tokens before each
    output's first difference over all the reference's tokens, and the share of identical outputs."""
    matched = sum(next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), min(len(out), len(ref)))
                  for out, ref in zip(outputs, reference, strict=True))  # fmt: skip
    return {"greedy_token_agreement": matched / max(1, sum(map(len, reference))),
            "identical_outputs": sum(list(o) == list(r) for o, r in zip(outputs, reference, strict=True)) / max(1, len(outputs))}  # fmt: skip


def core_loop_figures(before: dict[str, float], after: dict[str, float], duration_s: float) -> dict[str, dict]:
    """{"engine_core_loop": ...} over a timed span of `duration_s` between two scrapes of a server's counters
    (load.scrape_counters): the shares of it the core loop spent inside steps and on messages (the rest it waited),
    and what crossing the process boundary cost per step (the core's io: decoding messages in, encoding and
    sending outputs). {} when the server has no engine-core process (no loop counters)."""
    names = ("engine_core_loop_seconds:step", "engine_core_loop_seconds:io", "engine_core_steps", "engine_core_bytes_out")
    if not all(name in after for name in names):
        return {}
    # a counter the core had not reported yet when the span began (no step before it) started at zero
    step, io, steps, bytes_out = (after[name] - before.get(name, 0.0) for name in names)
    return {"engine_core_loop": {
        "step_share": ratio(step, duration_s), "io_share": ratio(io, duration_s),
        "idle_share": max(0.0, 1.0 - (step + io) / duration_s) if duration_s else None, "steps": steps,
        "step_ms": ratio(1e3 * step, steps), "io_us_per_step": ratio(1e6 * io, steps),
        "bytes_out_per_step": ratio(bytes_out, steps), "io_over_step_time": ratio(io, step)}}  # fmt: skip


def stat_list(m: dict, key: str, stats: Sequence[str]) -> str:
    """"median 1.2, p99 3.4": `m[key.format(stat)]` for each of `stats`."""
    return ", ".join(f"{stat} {num(m[key.format(stat)])}" for stat in stats)


# The summary's head: (label, key, format); request goodput only where SLOs were given.
_HEAD = (("Successful requests:", "completed", "d"), ("Failed requests:", "failed", "d"),
         ("Benchmark duration (s):", "duration_s", ".2f"), ("Total input tokens:", "total_input_tokens", "d"),
         ("Total generated tokens:", "total_output_tokens", "d"),
         ("Request throughput (req/s):", "request_throughput", ".2f"),
         ("Output token throughput (tok/s):", "output_throughput", ".2f"),
         ("Total token throughput (tok/s):", "total_token_throughput", ".2f"),
         ("Request goodput (req/s):", "request_goodput", ".2f"))  # fmt: skip


def format_metrics(m: dict, more: Sequence[tuple[str, Any]] = ()) -> str:
    """vLLM's text summary of one run's `compute_metrics`, then `more` (label, value) rows of the report's."""
    rows = [(label, num(m[key], spec)) for label, key, spec in _HEAD if m.get(key) is not None]
    stats = ["mean", "median", *(f"p{p:g}" for p in PERCENTILES if p != 50.0)]  # p50: the median again
    rows += [(f"{title} (ms):", stat_list(m, f"{{}}_{name}_ms", stats))
             for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))]
    return summary([*rows, *more])
