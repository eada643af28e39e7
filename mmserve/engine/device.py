"""The device an engine runs on and its default compute dtype: bf16 on CUDA, and on CPUs that compute bf16
natively (AVX-512 BF16 or AMX: oneDNN's bf16 GEMMs there stream half the bytes of fp32 at full speed); fp32 on
other CPUs, where bf16 products are emulated and slower than fp32. Knows nothing of models."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

DTYPE_ENV = "MMSERVE_DTYPE"  # the default of --dtype / EngineArgs.dtype when unset
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
# /proc/cpuinfo flags of native bf16 arithmetic (Intel Cooper Lake+ / Sapphire Rapids+, AMD Zen 4+).
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_device(device: str | None) -> torch.device:
    """`device` (cpu, cuda, cuda:N), or cuda when available, else cpu."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def resolve_dtype(dtype: str | None, device: torch.device) -> str:
    """`dtype`, else $MMSERVE_DTYPE, else "auto"; "auto" is `default_dtype(device)`."""
    name = (dtype or os.environ.get(DTYPE_ENV) or "auto").strip().lower()
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r} (${DTYPE_ENV})")
    return default_dtype(device) if name == "auto" else name


def default_dtype(device: torch.device) -> str:
    if device.type == "cuda":
        return "bfloat16"
    return "bfloat16" if device.type == "cpu" and cpu_has_native_bf16() else "float32"


@functools.cache
def cpu_has_native_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes bf16 natively and torch's oneDNN can use it. Linux x86 only: elsewhere False
    (the fp32 default is always correct, only slower)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return any(f in flags for f in _BF16_FLAGS) and torch.backends.mkldnn.is_available()
