"""`mmserve bench throughput --quick` on the tiny model with each system once: the text, prefix, image and
image + video workloads, transformers' continuous batching, mmserve's step-time split, greedy-token
agreement, and long-video (videos arriving into running decodes, encoder chunking on and off)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from mmserve.cli import main

SPLIT_KEYS = {"forward", "encoder", "sampling", "grammar", "host_overhead"}


def run_quick(model: Path, out: Path, workload: str, systems: list[str], *extra: str) -> dict:
    argv = ["bench", "throughput", "--model", str(model), "--quick", "--workload", workload]
    argv += ["--systems", ",".join(systems), "--hf-batch-size", "8", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_bench_throughput_structured_runs_side_by_side(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """--structured adds mmserve-structured: every request under a grammar, the same output lengths."""
    report = run_quick(tiny_model_dir("qwen2"), tmp_path / "s.json", "random", ["mmserve"], "--structured")
    assert list(report["systems"]) == ["mmserve", "mmserve-structured"]
    overhead = report["structured_overhead"]
    assert 0 < overhead["grammar_share_of_run"] < 1 and overhead["elapsed_over_unconstrained"] > 0
    assert report["systems"]["mmserve"]["step_time_split"]["grammar"] < overhead["grammar_share_of_run"]


@pytest.mark.parametrize(
    ("workload", "systems", "extra"),
    [
        ("random", ["mmserve", "mmserve-static", "hf-cb"], []),
        ("prefix", ["mmserve-no-chunk", "hf-static"], []),
        ("random-mm", ["mmserve", "hf-static"], []),
        # An image and a 4-frame video per prompt; transformers gets mmserve's video pixels.
        ("random-mm", ["mmserve", "hf-static"], ["--num-frames", "4", "--video-size", "56"]),
    ],
    ids=["random", "prefix", "random-mm", "random-mm-video"],
)
def test_bench_throughput_quick(
    tiny_model_dir: Callable[[str], Path],
    tmp_path: Path,
    workload: str,
    systems: list[str],
    extra: list[str],
) -> None:
    report = run_quick(tiny_model_dir("qwen2_vl"), tmp_path / "tput.json", workload, systems, *extra)
    assert report["config"]["workload"] == workload
    assert list(report["systems"]) == systems
    for name, r in report["systems"].items():
        assert r["output_tokens_per_s"] > 0 and r["efficiency"] > 0
        if name.startswith("mmserve"):
            split = r["step_time_split"]
            assert set(split) >= SPLIT_KEYS
            assert sum(split[k] for k in SPLIT_KEYS) == pytest.approx(1.0, abs=1e-6)
            assert (split["encoder"] > 0) == (workload == "random-mm")
            assert 0 < r["kv_cache_peak_usage"] <= 1
        else:
            assert r["step_time_split"] is None
    # Greedy tokens agree across mmserve and transformers (static and continuous batching, images too).
    assert all(v == 0 for v in report["outputs_differing_from_first_system"].values())


def test_repeats_report_each_systems_median_run(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    report = run_quick(
        tiny_model_dir("qwen2_vl"),
        tmp_path / "tput.json",
        "random",
        ["mmserve", "hf-static"],
        "--repeats",
        "3",
    )
    assert report["config"]["repeats"] == 3
    assert len(report["roofline_tokens_per_s_runs"]) == 3
    assert report["roofline_tokens_per_s"] == max(report["roofline_tokens_per_s_runs"])
    for r in report["systems"].values():
        runs = r["elapsed_s_runs"]
        assert len(runs) == 3 and r["elapsed_s"] == sorted(runs)[1]
    assert all(v == 0 for v in report["outputs_differing_from_first_system"].values())


def test_long_video_quick(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    systems = ["mmserve", "mmserve-no-chunk", "hf-static"]
    report = run_quick(tiny_model_dir("qwen2_vl"), tmp_path / "lv.json", "long-video", systems)
    assert all(v == 0 for v in report["outputs_differing_from_first_system"].values())
    video_tokens = report["workload"]["video_tokens"]
    assert video_tokens > 32 and len(report["workload"]["video_arrival_steps"]) == 2
    timelines = {}
    for name in ("mmserve", "mmserve-no-chunk"):
        r = report["systems"][name]
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"]
        assert 0 < r["median_step_s"] <= r["max_step_s"]
        assert r["max_step_over_median"] == pytest.approx(r["max_step_s"] / r["median_step_s"])
        assert 0 < r["max_step_since_video_s"] <= r["max_step_s"]
        timelines[name] = r["timeline"]
        assert len(r["timeline"]) > 1
        assert r["max_encoder_tokens_in_a_step"] == max(s["encoder_tokens"] for s in r["timeline"])
    # Chunked: each video's encoder work spread over steps under the 32-token encoder budget, beside
    # the running decodes. Unchunked: some step encodes a whole video (and runs no decodes).
    chunked, whole = timelines["mmserve"], timelines["mmserve-no-chunk"]
    assert max(s["encoder_tokens"] for s in chunked) <= 32 < video_tokens
    assert any(s["encoder_tokens"] and s["decode_tokens"] for s in chunked)
    assert any(s["encoder_tokens"] >= video_tokens and not s["decode_tokens"] for s in whole)
    assert report["systems"]["hf-static"]["itl_p99_ms"] is None  # static batches: no arrivals, no ITL
    assert report["p99_itl_chunk_over_no_chunk"] > 0
    assert report["throughput_cost_of_chunking"] < 1


def test_long_video_with_an_encoder_token_cost_keeps_greedy_outputs(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    report = run_quick(
        tiny_model_dir("qwen2_vl"), tmp_path / "lv.json", "long-video", ["mmserve", "hf-static"],
        "--encoder-token-cost", "1",
    )  # fmt: skip
    assert report["config"]["encoder_token_cost"] == 1.0
    assert all(v == 0 for v in report["outputs_differing_from_first_system"].values())
    # Every step that encodes gives up budget for it: its tokens and its encoder tokens fit the 64.
    timeline = report["systems"]["mmserve"]["timeline"]
    encoding = [s for s in timeline if s["encoder_tokens"]]
    assert encoding and all(s["decode_tokens"] + s["prefill_tokens"] < 64 for s in encoding)


@pytest.mark.parametrize(
    "args",
    [
        ["--workload", "random-mm", "--systems", "hf-cb"],
        ["--workload", "long-video", "--systems", "hf-cb"],
        ["--workload", "random-mm", "--num-images", "0", "--systems", "mmserve"],  # and no video
        ["--workload", "random", "--repeats", "0", "--systems", "mmserve"],
    ],
)
def test_refused_workloads(tiny_model_dir: Callable[[str], Path], args: list[str]) -> None:
    argv = ["bench", "throughput", "--model", str(tiny_model_dir("qwen2_vl")), "--quick"]
    assert main([*argv, *args]) == 2


def test_qwen3_vl_moe_against_hf_static_reports_the_expert_share(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Qwen3-VL-MoE, image requests, beside transformers' generate() (mm_token_type_ids): the ratio and the
    share of decoder-forward time inside the SparseMoE modules (bench hooks) are finite and in range."""
    report = run_quick(
        tiny_model_dir("qwen3_vl_moe"), tmp_path / "moe.json", "random-mm", ["mmserve", "hf-static"],
        "--repeats", "2",
    )  # fmt: skip
    mm, hf = report["systems"]["mmserve"], report["systems"]["hf-static"]
    assert math.isfinite(mm["ratio_to_hf_static"]) and mm["ratio_to_hf_static"] > 0
    assert 0 < mm["expert_share"] < 1
    assert len(mm["expert_share_runs"]) == 2 and all(0 < x < 1 for x in mm["expert_share_runs"])
    assert hf["expert_share"] is None and hf["expert_share_runs"] is None
    assert mm["cpu_s"] > 0 and len(mm["cpu_s_runs"]) == 2
    assert math.isfinite(mm["cpu_ratio_to_hf_static"]) and mm["cpu_ratio_to_hf_static"] > 0
    assert all(v == 0 for v in report["outputs_differing_from_first_system"].values())


def test_dense_model_has_no_expert_share(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    report = run_quick(tiny_model_dir("qwen2"), tmp_path / "dense.json", "random", ["mmserve"])
    assert report["systems"]["mmserve"]["expert_share"] is None


def test_long_video_qwen3_vl_counts_every_temporal_group(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Qwen3-VL's video is one input per temporal group: video_tokens sums them, mmserve-no-chunk encodes a
    whole video in one step, mmserve at most the 32-token encoder budget; the step ratios are finite."""
    systems = ["mmserve", "mmserve-no-chunk"]
    report = run_quick(tiny_model_dir("qwen3_vl"), tmp_path / "lv3.json", "long-video", systems)
    video_tokens = report["workload"]["video_tokens"]
    chunked, whole = report["systems"]["mmserve"], report["systems"]["mmserve-no-chunk"]
    assert chunked["max_encoder_tokens_in_a_step"] <= 32 < video_tokens <= whole["max_encoder_tokens_in_a_step"]
    for r in (chunked, whole):
        assert math.isfinite(r["max_step_since_video_over_median"]) and r["max_step_since_video_over_median"] > 0
    assert report["outputs_differing_from_first_system"]["mmserve-no-chunk"] == 0


def test_bench_long_video_compares_step_time_targets(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """`bench long-video --max-step-ms 250,0`: one chunked run per target (0: fixed token budgets), each
    with the video's TTFT and the longest step (the decodes' longest gap) against the target."""
    out = tmp_path / "lv.json"
    argv = ["bench", "long-video", "--quick", "--model", str(tiny_model_dir("qwen2_vl"))]
    assert main([*argv, "--max-step-ms", "250,0", "--no-whole", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["chunk_encoder"], r["max_step_ms"]) for r in runs] == [(True, 250.0), (True, None)]
    for r in runs:
        assert r["video_ttft_s"] > 0 and r["temporal_groups"] == 8
        assert sum(t["encoder_tokens"] for t in r["timeline"]) == r["video_tokens"]
        assert min(t["decode_tokens"] for t in r["timeline"]) == 4  # every decode in every step
    assert runs[0]["max_over_target"] == runs[0]["max_step_s"] / 0.25 and runs[1]["max_over_target"] is None
