"""Serving metrics with `vllm bench serve`'s definitions (TTFT, TPOT, ITL, e2e latency, throughput,
goodput), as pure functions over per-request timings. Knows nothing of transports or the engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - ttft) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive deltas (one delta may carry several tokens, as in vLLM)."""
        t = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(t)]


def parse_goodput(specs: Sequence[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds); ValueError if malformed."""
    slos: dict[str, float] = {}
    for spec in specs or ():
        name, sep, value = spec.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"goodput: expected NAME:MS with NAME in {GOODPUT_METRICS}, got {spec!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput: {spec!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"goodput: {spec!r}: the SLO must be positive")
        slos[name] = ms
    return slos


def meets_slos(timing: RequestTiming, slos: dict[str, float]) -> bool:
    """A request counts toward goodput only if it succeeded and every given SLO holds (ms, <=).
    TPOT of a one-token request is 0, as in vLLM."""
    if not timing.success or timing.ttft_s is None:
        return False
    values_ms = {
        "ttft": timing.ttft_s * 1e3,
        "tpot": (timing.tpot_s or 0.0) * 1e3,
        "e2el": timing.e2el_s * 1e3,
    }
    return all(values_ms[name] <= limit for name, limit in slos.items())


def summarize_ms(values_s: Sequence[float], name: str, percentiles: Sequence[float] = PERCENTILES) -> dict:
    """mean / median / std / pXX of `values_s`, in milliseconds, under vLLM's key names; 0 when empty."""
    arr = np.asarray(values_s, dtype=np.float64) * 1e3
    out = {
        f"mean_{name}_ms": float(arr.mean()) if arr.size else 0.0,
        f"median_{name}_ms": float(np.median(arr)) if arr.size else 0.0,
        f"std_{name}_ms": float(arr.std()) if arr.size else 0.0,
    }
    for p in percentiles:
        key = f"p{p:g}_{name}_ms"
        out[key] = float(np.percentile(arr, p)) if arr.size else 0.0
    return out


def throughput_figures(num_requests: int, input_tokens: int, output_tokens: int, duration_s: float) -> dict:
    """Duration, token totals and request / output / total token throughput, under vLLM's key names."""
    return {
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": num_requests / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }


def compute_metrics(
    timings: Sequence[RequestTiming],
    duration_s: float,
    goodput_slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> dict:
    """Every figure of one run. Throughputs are over `duration_s` (first send to last finish)."""
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    ok = [t for t in timings if t.success]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    tpots = [t.tpot_s for t in ok if t.tpot_s is not None]
    itls = [gap for t in ok for gap in t.itls_s]
    e2els = [t.e2el_s for t in ok]
    total_in = sum(t.prompt_tokens for t in ok)
    total_out = sum(t.output_tokens for t in ok)
    metrics: dict = {
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        **throughput_figures(len(ok), total_in, total_out, duration_s),
        "goodput_slos_ms": dict(goodput_slos) if goodput_slos else None,
        "request_goodput": (
            sum(meets_slos(t, goodput_slos) for t in timings) / duration_s if goodput_slos else None
        ),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(summarize_ms(values, name, percentiles))
    return metrics


def first_vs_repeats_ttft(timings: Sequence[RequestTiming]) -> dict:
    """TTFT of request 0 against the others' (the `prefix` workload sends request 0 alone, so it is the
    cold miss and the others share its cached prefix). Keys `ttft_first_ms`, `ttft_repeats_median_ms`,
    `ttft_repeats_p90_ms` and `ttft_repeats_over_first` (median / first); None where a figure is
    missing: request 0 failed before its first token, or no other request got one."""
    first = timings[0].ttft_s if timings and timings[0].success else None
    repeats = [t.ttft_s for t in timings[1:] if t.success and t.ttft_s is not None]
    median = float(np.median(repeats)) * 1e3 if repeats else None
    return {
        "ttft_first_ms": first * 1e3 if first is not None else None,
        "ttft_repeats_median_ms": median,
        "ttft_repeats_p90_ms": float(np.percentile(repeats, 90.0)) * 1e3 if repeats else None,
        "ttft_repeats_over_first": median / (first * 1e3) if median is not None and first else None,
    }


def video_interference(texts: Sequence[RequestTiming], videos: Sequence[RequestTiming]) -> dict:
    """The `long-video` workload's figures: how the text streams' inter-token latency fared while the
    videos were in the server, against the rest of the run. The window runs from the first video's send
    to the last video's end; a text gap belongs to it when its later token arrived inside. Keys
    `video_window_s`, `text_itl_{in,out}_window_{p50,p99,max}_ms`, `text_itl_in_window_gaps`,
    `video_ttft_{median,max}_ms` (None where there is nothing to measure)."""
    done = [v for v in videos if v.success]
    lo = min((v.start_s for v in done), default=None)
    hi = max((v.end_s for v in done), default=None)
    inside: list[float] = []
    outside: list[float] = []
    for t in texts:
        if not t.success:
            continue
        for a, b in itertools.pairwise(t.chunk_times_s):
            (inside if lo is not None and hi is not None and lo <= b <= hi else outside).append(b - a)
    out: dict = {"video_window_s": hi - lo if lo is not None and hi is not None else None}
    for where, gaps in (("in", inside), ("out", outside)):
        arr = np.asarray(gaps, dtype=np.float64) * 1e3
        for name, value in (
            ("p50", np.median(arr) if arr.size else None),
            ("p99", np.percentile(arr, 99.0) if arr.size else None),
            ("max", arr.max() if arr.size else None),
        ):
            out[f"text_itl_{where}_window_{name}_ms"] = None if value is None else float(value)
    out["text_itl_in_window_gaps"] = len(inside)
    ttfts = [v.ttft_s * 1e3 for v in done if v.ttft_s is not None]
    out["video_ttft_median_ms"] = float(np.median(ttfts)) if ttfts else None
    out["video_ttft_max_ms"] = max(ttfts) if ttfts else None
    return out


def format_metrics(m: dict) -> str:
    """vLLM-like text summary."""
    lines = [
        f"{'Successful requests:':<40}{m['completed']:>12}",
        f"{'Failed requests:':<40}{m['failed']:>12}",
        f"{'Benchmark duration (s):':<40}{m['duration_s']:>12.2f}",
        f"{'Total input tokens:':<40}{m['total_input_tokens']:>12}",
        f"{'Total generated tokens:':<40}{m['total_output_tokens']:>12}",
        f"{'Request throughput (req/s):':<40}{m['request_throughput']:>12.2f}",
        f"{'Output token throughput (tok/s):':<40}{m['output_throughput']:>12.2f}",
        f"{'Total token throughput (tok/s):':<40}{m['total_token_throughput']:>12.2f}",
    ]
    if m.get("request_goodput") is not None:
        lines.append(f"{'Request goodput (req/s):':<40}{m['request_goodput']:>12.2f}")
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        parts = [f"mean {m[f'mean_{name}_ms']:.1f}", f"median {m[f'median_{name}_ms']:.1f}"]
        parts += [
            f"{k.split('_')[0]} {v:.1f}"
            for k, v in m.items()
            if k.startswith("p") and k.endswith(f"_{name}_ms") and not k.startswith("p50_")
        ]
        lines.append(f"{title + ' (ms):':<20}" + ", ".join(parts))
    return "\n".join(lines)
