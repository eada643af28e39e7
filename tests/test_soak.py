"""A short `make soak` (in-process server on the tiny model): mixed traffic with cancellations and
disconnects leaves no unintended error, no request, KV block or encoder-cache reference behind."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.soak import SoakConfig, format_report, run_soak


def test_short_soak_leaves_nothing_behind(tiny_model_dir: Callable[[str], Path]) -> None:
    cfg = SoakConfig(duration_s=12, concurrency=4, cancel_rate=0.2, disconnect_rate=0.2, warmup_s=4, seed=1)
    report = run_soak(cfg, tiny_model_dir("qwen2_vl"), progress=False)
    text = format_report(report)
    assert report.unintended_errors == 0, text
    assert report.num_running_end == 0 and report.kv_blocks_held_end == 0, text
    assert report.encoder_tokens_referenced_end == 0, text
    # Every kind of ending happened, over every transport and every kind of media.
    assert {"completed", "cancelled", "disconnected"} <= set(report.outcomes), text
    assert {k.split("/")[0] for k in report.by_kind} == {"json", "sse", "ws"}, text
    assert {k.split("/")[1] for k in report.by_kind} >= {"text", "image"}, text
    assert report.latency_p50_s is not None and report.rss_start_mib is not None, text
    # Memory growth is judged by the long run (docs/reliability.md), not by 12 s of warm-up.
    assert "unintended errors: 0" in text and ("PASS" in text or "resident memory grew" in text)
