"""`mmserve bench kernels --smoke`: the whole script (case building, the SDPA baseline, the table, the JSON) on
the CPU in Triton's interpreter, in a fresh process (TRITON_INTERPRET must be set before triton is imported).
The paged kernel must agree with SDPA over the gathered K/V; timings are not judged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_kernels_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    done = subprocess.run([sys.executable, "-m", "mmserve", "bench", "kernels", "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "decode b=2 ctx=64" in done.stdout and f"wrote {out}" in done.stdout
    report = json.loads(out.read_text())
    assert report["shape"]["dtype"] == "torch.float32"
    names = [r["name"] for r in report["results"]]
    assert names == ["decode b=1 ctx=64", "decode b=2 ctx=64", "mixed: chunk 20 @30 + 2 decodes @40"]
    for r in report["results"]:
        assert r["max_abs_diff"] < 1e-5  # the paged kernel equals SDPA over the same K/V
        assert r["triton_ms"] > 0 and r["sdpa_ms"] > 0 and r["kv_bytes"] > 0 and r["num_splits"] >= 1
    mixed = report["results"][2]
    assert (mixed["num_seqs"], mixed["num_tokens"], mixed["max_context"]) == (3, 22, 50)


def test_bench_kernels_without_a_gpu_says_so() -> None:
    import torch

    if torch.cuda.is_available():  # pragma: no cover - the CPU machines have none
        return
    done = subprocess.run([sys.executable, "-m", "mmserve", "bench", "kernels"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and "needs a CUDA device (or --smoke" in done.stderr
