"""`--plot`: PNGs from synthetic bench reports, and `bench long-video --quick --plot` on the tiny model
(matplotlib is optional: skipped without it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mmserve.bench.plots import plot_serve, plot_throughput
from mmserve.cli import main

pytest.importorskip("matplotlib")


def test_throughput_bars_and_latency_cdfs(tmp_path: Path) -> None:
    systems = {
        name: {"system": name, "output_tokens_per_s": rate, "efficiency": rate / 500}
        for name, rate in (("mmserve", 300.0), ("hf-static", 100.0))
    }
    tput = {"config": {"workload": "random"}, "systems": systems, "output_tokens_per_s_bound": 500.0}
    row = {"ttft_s": 0.1, "tpot_s": 0.01, "itls_s": [0.01, 0.02], "e2el_s": 0.3, "success": True}
    failed = {"ttft_s": None, "tpot_s": None, "itls_s": [], "e2el_s": 0.1, "success": False}
    serve = {"config": {"workload": "random"}, "requests": {"ws": [row, row, failed], "http": [row]}}
    paths = plot_throughput(tput, tmp_path) + plot_serve(serve, tmp_path)
    assert [p.name for p in paths] == ["throughput-random.png", "serve-latency-cdf-random.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_throughput_long_video_adds_the_step_timelines(tmp_path: Path) -> None:
    step = {"duration_s": 0.01, "decode_tokens": 8, "prefill_tokens": 32, "encoder_tokens": 32}
    systems = {
        name: {
            "system": name,
            "output_tokens_per_s": 50.0,
            "efficiency": 0.1,
            "itl_p99_ms": 9.0,
            "timeline": tl,
        }
        for name, tl in (("mmserve", [step] * 3), ("mmserve-no-chunk", [step]), ("hf-static", None))
    }
    report = {"config": {"workload": "long-video"}, "systems": systems, "output_tokens_per_s_bound": 500.0}
    paths = plot_throughput(report, tmp_path)
    assert [p.name for p in paths] == ["throughput-long-video.png", "throughput-long-video-steps.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_long_video_quick_writes_the_step_timeline(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    out = tmp_path / "lv.json"
    argv = ["bench", "long-video", "--model", str(tiny_model_dir("qwen2_vl")), "--quick"]
    assert main([*argv, "--json", str(out), "--plot", str(tmp_path)]) == 0
    report = json.loads(out.read_text())
    on, off = report["runs"]
    assert on["chunk_encoder"] and not off["chunk_encoder"]
    # Chunked: the encoder work is spread over several steps under the 32-token encoder budget.
    assert len(on["timeline"]) == on["steps"] > 1
    assert (
        max(s["encoder_tokens"] for s in on["timeline"])
        <= 32
        < max(s["encoder_tokens"] for s in off["timeline"])
    )
    assert (tmp_path / "long-video-steps.png").read_bytes()[:4] == b"\x89PNG"
