"""Shared fixtures: tiny checkpoints generated once per test session (nothing is downloaded)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's interpreter; it must be chosen before anything (e.g.
# transformers) first imports triton. `import torch` alone does not.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The parity suites compare fp32 engines with transformers in fp32: an engine given no dtype would pick bf16 on a
# CPU with native bf16 (engine/device.py). Tests of that default unset this; servers the tests start inherit it.
os.environ.setdefault("MMSERVE_DTYPE", "float32")

# Every engine the tests start runs its decode-sized linear products through the C kernel where it builds (the
# fastest path at few rows on most CPUs; `kernels/cpu_linear.py`), without measuring at each start; the measured
# choice has tests of its own.
if shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc"):
    os.environ.setdefault("MMSERVE_CPU_LINEAR", "c")

ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen2")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """arch -> directory of a tiny random checkpoint of that architecture (made on first use)."""
    from mmserve.tiny_model import make_tiny_model

    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(
                tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, preset="tiny", seed=0
            )
        return made[arch]

    return get
