"""`mmserve bench throughput --quick` on the tiny model with each system once: the text, prefix and image
workloads, transformers' continuous batching, mmserve's step-time split, and greedy-token agreement."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mmserve.cli import main

SPLIT_KEYS = {"forward", "encoder", "sampling", "host_overhead"}


@pytest.mark.parametrize(
    ("workload", "systems"),
    [
        ("random", ["mmserve", "mmserve-static", "hf-cb"]),
        ("prefix", ["mmserve-no-chunk", "hf-static"]),
        ("random-mm", ["mmserve", "hf-static"]),
    ],
)
def test_bench_throughput_quick(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path, workload: str, systems: list[str]
) -> None:
    out = tmp_path / "tput.json"
    argv = ["bench", "throughput", "--model", str(tiny_model_dir("qwen2_vl")), "--quick"]
    argv += [
        "--workload",
        workload,
        "--systems",
        ",".join(systems),
        "--hf-batch-size",
        "8",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
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


def test_hf_cb_refuses_image_workloads(tiny_model_dir: Callable[[str], Path]) -> None:
    argv = ["bench", "throughput", "--model", str(tiny_model_dir("qwen2_vl")), "--quick"]
    assert main([*argv, "--workload", "random-mm", "--systems", "hf-cb"]) == 2
