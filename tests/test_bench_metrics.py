"""`mmserve.bench.metrics` on fixed synthetic timings: TTFT, TPOT, ITL, e2e, percentiles, goodput, and
the prefix workload's first-vs-repeats TTFT, the long-video workload's ITL while videos are in."""

from __future__ import annotations

import pytest

from mmserve.bench.metrics import (
    RequestTiming,
    compute_metrics,
    first_vs_repeats_ttft,
    format_metrics,
    meets_slos,
    parse_goodput,
    summarize_ms,
    video_interference,
)

# start 0, deltas at 0.1, 0.15, 0.25, done at 0.3: 4 tokens (the last delta carried two).
A = RequestTiming(0.0, (0.1, 0.15, 0.25), 0.3, prompt_tokens=10, output_tokens=4)
# start 1.0, one token at 1.5, done 1.5.
B = RequestTiming(1.0, (1.5,), 1.5, prompt_tokens=20, output_tokens=1)
# failed before any token.
C = RequestTiming(2.0, (), 2.1, prompt_tokens=0, output_tokens=0, success=False, error="boom")


def test_per_request_definitions() -> None:
    assert A.ttft_s == pytest.approx(0.1)
    assert A.e2el_s == pytest.approx(0.3)
    assert A.tpot_s == pytest.approx((0.3 - 0.1) / 3)  # (e2e - TTFT) / (out - 1)
    assert A.itls_s == pytest.approx([0.05, 0.1])
    assert B.tpot_s is None and B.itls_s == []
    assert C.ttft_s is None


def test_summary_percentiles_match_numpy_linear_interpolation() -> None:
    s = summarize_ms([0.001 * v for v in range(1, 101)], "x")  # 1..100 ms
    assert s["mean_x_ms"] == pytest.approx(50.5)
    assert s["median_x_ms"] == pytest.approx(50.5)
    assert s["p90_x_ms"] == pytest.approx(90.1)
    assert s["p99_x_ms"] == pytest.approx(99.01)
    assert summarize_ms([], "x")["p99_x_ms"] == 0.0


def test_compute_metrics_on_fixed_timings() -> None:
    m = compute_metrics([A, B, C], duration_s=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["total_token_throughput"] == pytest.approx(17.5)
    assert m["mean_ttft_ms"] == pytest.approx((100 + 500) / 2)
    assert m["median_ttft_ms"] == pytest.approx(300)
    # Only A has a TPOT (B has one token); the ITL list pools every gap of every request.
    assert m["mean_tpot_ms"] == pytest.approx(200 / 3)
    assert m["mean_itl_ms"] == pytest.approx(75)
    assert m["p99_itl_ms"] == pytest.approx(50 + 0.99 * 50)
    assert m["mean_e2el_ms"] == pytest.approx(400)
    assert m["request_goodput"] is None
    assert "Output token throughput" in format_metrics(m)


def test_goodput_counts_a_request_only_if_every_slo_holds() -> None:
    assert parse_goodput(["ttft:200", "TPOT:70", "e2el:1000"]) == {"ttft": 200, "tpot": 70, "e2el": 1000}
    # A: ttft 100, tpot 66.7, e2el 300. B: ttft 500, tpot 0 (one token), e2el 500. C failed.
    assert meets_slos(A, {"ttft": 200, "tpot": 70})
    assert not meets_slos(A, {"ttft": 200, "tpot": 60})
    assert meets_slos(B, {"tpot": 1})
    assert not meets_slos(B, {"ttft": 200})
    assert not meets_slos(C, {"e2el": 1e9})
    m = compute_metrics([A, B, C], duration_s=2.0, goodput_slos={"e2el": 400})
    assert m["request_goodput"] == pytest.approx(0.5)
    m = compute_metrics([A, B, C], duration_s=2.0, goodput_slos={"e2el": 600, "tpot": 100})
    assert m["request_goodput"] == pytest.approx(1.0)


@pytest.mark.parametrize("spec", ["ttft", "ttft:abc", "queue:5", "ttft:-1", "ttft:0"])
def test_bad_goodput_specs_are_errors(spec: str) -> None:
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput([spec])


def test_first_vs_repeats_ttft() -> None:
    # Request 0 is A (TTFT 100 ms); repeats B (500 ms), C (failed: left out) and D (300 ms).
    d = RequestTiming(5.0, (5.3,), 5.3, prompt_tokens=10, output_tokens=1)
    f = first_vs_repeats_ttft([A, B, C, d])
    assert f["ttft_first_ms"] == pytest.approx(100)
    assert f["ttft_repeats_median_ms"] == pytest.approx(400)
    assert f["ttft_repeats_p90_ms"] == pytest.approx(300 + 0.9 * 200)
    assert f["ttft_repeats_over_first"] == pytest.approx(4.0)
    # A failed first request or no repeats: the figures that need them are None, nothing raises.
    assert first_vs_repeats_ttft([C, A])["ttft_first_ms"] is None
    assert first_vs_repeats_ttft([C, A])["ttft_repeats_over_first"] is None
    assert first_vs_repeats_ttft([A])["ttft_repeats_median_ms"] is None
    assert first_vs_repeats_ttft([]) == dict.fromkeys(f)


def test_video_interference_splits_text_gaps_at_the_video_window() -> None:
    # Two text streams, one token every 0.1 s from t=0.1 to 2.0, except a 0.5 s stall ending at 1.3.
    ticks = [round(0.1 * i, 1) for i in range(1, 21)]
    stalled = tuple(t for t in ticks if not 0.8 < t < 1.3)
    texts = [RequestTiming(0.0, tuple(ticks), 2.0, 5, 20), RequestTiming(0.0, stalled, 2.0, 5, 15), C]
    # Videos: sent at 1.0 and 1.2, first token at 1.3 and 1.5, done at 1.4 and 1.6 (window 1.0-1.6).
    videos = [RequestTiming(1.0, (1.3, 1.4), 1.4, 500, 2), RequestTiming(1.2, (1.5,), 1.6, 500, 1)]
    f = video_interference(texts, videos)
    assert f["video_window_s"] == pytest.approx(0.6)
    # Gaps ending in [1.0, 1.6]: 1.0 .. 1.6 on the steady stream (7), 1.3 .. 1.6 on the stalled one (4).
    assert f["text_itl_in_window_gaps"] == 11
    assert f["text_itl_in_window_max_ms"] == pytest.approx(500)
    assert f["text_itl_out_window_max_ms"] == pytest.approx(100)
    assert f["text_itl_in_window_p50_ms"] == pytest.approx(100)
    assert f["video_ttft_median_ms"] == pytest.approx(300)
    assert f["video_ttft_max_ms"] == pytest.approx(300)
    # No video finished: no window, every text gap counts as outside, nothing raises.
    none = video_interference(texts, [C])
    assert none["video_window_s"] is None and none["text_itl_in_window_gaps"] == 0
    assert none["text_itl_in_window_p99_ms"] is None and none["video_ttft_median_ms"] is None
    assert none["text_itl_out_window_max_ms"] == pytest.approx(500)
