"""`mmserve bench tensor-parallel` end to end on the tiny Qwen2 model: TP=1 and TP=2 side by side at two
concurrencies, the report's structure, and the collective bytes (none with one rank, the layers'
recipe with two). No wall-clock thresholds."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from mmserve.cli import main

ROW_KEYS = {
    "num_steps", "median_step_s", "p90_step_s", "median_forward_s", "median_sampling_s", "median_other_s",
    "decode_tokens_per_s", "mean_comm_bytes", "comm_bytes_per_decode_token", "all_reduce_bytes_per_decode_token",
    "comm_bytes_model", "comm_bytes_match_model", "round_median_step_s", "step_durations_s",
    "outputs_differing_from_first_size",
}  # fmt: skip


def test_bench_tensor_parallel_tiny(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model = tiny_model_dir("qwen2")
    argv = ["bench", "tensor-parallel", "--model", str(model), "--concurrency", "1,4", "--input-len", "8"]
    argv += ["--output-len", "6", "--rounds", "2", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    report = json.loads((tmp_path / "tensor_parallel.json").read_text())
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "tensor_parallel.png").stat().st_size > 0

    assert report["config"]["tensor_parallel_sizes"] == [1, 2]
    assert report["config"]["concurrency"] == [1, 4]
    assert report["machine"]["cpu_model"] and report["machine"]["torch_threads"] >= 1
    assert report["machine"]["contention"]["wall_s"] > 0
    assert set(report["engines"]) == {"1", "2"}
    assert all(e["torch_threads_per_rank"] >= 1 for e in report["engines"].values())
    assert report["base_tensor_parallel_size"] == 1
    assert set(report["step_time_ratio_to_base"]) == {"2"}
    assert set(report["step_time_ratio_to_base"]["2"]) == {"1", "4"}
    assert all(r > 0 for r in report["step_time_ratio_to_base"]["2"].values())
    for tp, by_c in report["results"].items():
        assert set(by_c) == {"1", "4"}
        for c, row in by_c.items():
            assert set(row) >= ROW_KEYS
            # 5 decode steps per run (6 tokens, the first from the prefill), 2 rounds
            assert row["num_steps"] == 10 == len(row["step_durations_s"])
            assert len(row["round_median_step_s"]) == 2
            assert 0 < row["median_forward_s"] <= row["median_step_s"] <= row["p90_step_s"]
            assert row["comm_bytes_match_model"]
            if tp == "1":
                assert row["mean_comm_bytes"] == 0 and row["all_reduce_bytes_per_decode_token"] == 0
            else:
                assert row["mean_comm_bytes"] > 0
                # all-reduced bytes per token do not depend on how many tokens the step carries
                assert row["all_reduce_bytes_per_decode_token"] == row["comm_bytes_model"][
                    "all_reduce"
                ] / int(c)
    two = report["results"]["2"]
    assert two["4"]["mean_comm_bytes"] == 4 * two["1"]["mean_comm_bytes"]
    assert two["1"]["all_reduce_bytes_per_decode_token"] == two["4"]["all_reduce_bytes_per_decode_token"] > 0
