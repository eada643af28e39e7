"""`mmserve bench disagg --quick` on the tiny Qwen2-VL: a colocated instance and a prefill + decode pair behind
vllm-router run the same requests; the JSON has every figure of both, the decode instance read KV blocks, and
the two systems' greedy outputs agree."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mmserve.bench.disagg import _FIGURES, SYSTEMS
from mmserve.cli import main

pytestmark = pytest.mark.timeout(300)


def test_bench_disagg_quick(tiny_model_dir: Callable[[str], Path], tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "disagg.json"
    assert main(["bench", "disagg", "--model", str(tiny_model_dir("qwen2_vl")), "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    figures = {k for _, k in _FIGURES}
    for system in SYSTEMS:
        r = report["results"][system]
        assert figures <= set(r) and r["failed"] == 0 and not r["errors"], r
        assert r["output_throughput"] > 0 and r["long_ttft_p50_ms"] > 0
    d = report["results"]["disagg"]
    assert d["reads_done"] > 0 and d["reads_failed"] == 0 and d["blocks_read"] > 0
    assert d["read_ms_per_block"] > 0 and d["read_mb_per_s"] > 0 and d["kv_block_bytes"] > 0
    assert set(report["disagg_over_colocated"]) == figures
    assert report["greedy_agreement"] == 1.0 and report["greedy_failed"] == 0
    assert report["prefill_leases_after"] == 0
    assert "greedy agreement" in capsys.readouterr().out
