"""The CPU's few-row linear products (decode batches): which product each row count takes, chosen once
per machine, model and dtype by timing them over the model's own weights, and cached on disk.

Paths, all with F.linear's contract (`x [rows, in] @ weight [out, in]^T + bias`):
- "mm_t": (W @ x^T)^T through BLAS, returned column-major (every consumer takes the view as is);
- "linear": F.linear;
- "c": the C kernel `csrc/small_linear.c` (fp32 / bf16), which streams each weight row once per call.
With few rows the product is bound by reading the weights from memory, and how close BLAS comes to the
memory's rate depends on the row count, the dtype and the CPU in ways no rule captures: hence measured.
Rows past `MAX_ROWS`, other devices and other dtypes take F.linear. `MMSERVE_CPU_LINEAR=auto|mm_t|linear|c`
(default auto) forces one path for every row count up to `MAX_ROWS`."""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from mmserve.kernels.cbuild import CKernel, cache_dir, cpu_fingerprint

log = logging.getLogger(__name__)

PATHS = ("mm_t", "linear", "c")
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # a row count takes its bucket's path
MAX_ROWS = ROW_BUCKETS[-1]
ENV = "MMSERVE_CPU_LINEAR"
_MEASURE_BYTES = 256 << 20  # weights timed per pass: many times any L3, so the pass streams from memory
_MEASURE_ROUNDS = 3  # timed passes per (row count, path); the fastest counts (noise only slows a pass)
# A measurement whose passes of one path spread wider than this (slowest / fastest, passes over 1 ms) ran
# beside other work on the same cores: used for this start, never cached.
_STABLE_SPREAD = 1.5
_C_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# (x, weight, bias or NULL, out, rows, in_features, out_features, dtype, num_threads)
# -ffp-contract=off -fno-associative-math: the source fuses its products and orders its sums itself, the same
# way at every row count (a row's result must not depend on the rows beside it)
_KERNEL = CKernel("small_linear.c", "small_linear", [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64],
                  cflags=("-ffp-contract=off", "-fno-associative-math"))  # fmt: skip


def load() -> ctypes._CFuncPtr | None:
    """The compiled kernel, building it on first use; None (with one warning) where no C compiler works."""
    return _KERNEL.load()


def mm_t_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight [out, in]^T + bias computed as (W @ x^T)^T: [rows, out], column-major."""
    out_t = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, x.t())
    return out_t.t()  # every consumer (split + view, elementwise ops, the residual, the sampler) takes it as is


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[0] >= 1
        and x.dtype in _C_DTYPES
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
    )


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through the C kernel (fp32 sums in the kernel's own order; bf16 results rounded to nearest
    even); inputs it does not take, or no kernel, go to `mm_t_linear`. -> [rows, out], row-major."""
    kernel = load()
    if kernel is None or not supports(x, weight, bias):
        return mm_t_linear(x, weight, bias)
    x = x.contiguous()
    rows, in_features = x.shape
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype)
    bias_ptr = None if bias is None else bias.data_ptr()
    args = (x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(), rows, in_features, weight.shape[0])
    code = kernel(*args, _C_DTYPES[x.dtype], torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"small_linear failed with code {code}")
    return out


_PRODUCTS = {"mm_t": mm_t_linear, "linear": F.linear, "c": small_linear}


@dataclass(frozen=True)
class LinearPaths:
    """The path of each row bucket (`paths[i]` for rows in (ROW_BUCKETS[i-1], ROW_BUCKETS[i]]); rows past
    MAX_ROWS and tensors off the CPU take F.linear."""

    paths: tuple[str, ...]
    _by_rows: tuple[str, ...] = field(init=False, repr=False, compare=False)  # index: row count

    def __post_init__(self) -> None:
        if len(self.paths) != len(ROW_BUCKETS) or not set(self.paths) <= set(PATHS):
            raise ValueError(f"one path of {PATHS} per row bucket {ROW_BUCKETS}, got {self.paths}")
        by_rows, bucket = ["linear"], 0
        for rows in range(1, MAX_ROWS + 1):
            bucket += rows > ROW_BUCKETS[bucket]
            by_rows.append(self.paths[bucket])
        object.__setattr__(self, "_by_rows", tuple(by_rows))

    @classmethod
    def uniform(cls, path: str) -> LinearPaths:
        return cls((path,) * len(ROW_BUCKETS))

    def path(self, rows: int) -> str:
        return self._by_rows[rows] if 0 < rows <= MAX_ROWS else "linear"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear's contract, through this row count's path on the CPU."""
        if x.device.type != "cpu" or x.dim() != 2:
            return F.linear(x, weight, bias)
        return _PRODUCTS[self.path(x.shape[0])](x, weight, bias)

    def describe(self) -> str:
        """e.g. "rows 1-4: c, 6-16: mm_t, 24-128: linear"."""
        runs: list[tuple[int, int, str]] = []
        low = 1
        for bucket, path in zip(ROW_BUCKETS, self.paths, strict=True):
            if runs and runs[-1][2] == path:
                runs[-1] = (runs[-1][0], bucket, path)
            else:
                runs.append((low, bucket, path))
            low = bucket + 1
        return "rows " + ", ".join(f"{a}-{b}: {p}" if a != b else f"{a}: {p}" for a, b, p in runs)


BLAS_PATHS = LinearPaths.uniform("mm_t")  # what every layer runs until a model is given its measured paths


def choose_paths(
    device: torch.device, weights: Sequence[tuple[torch.Tensor, torch.Tensor | None]], setting: str | None = None
) -> LinearPaths:
    """The paths a model whose linear layers hold `weights` (in forward order) takes on `device`.
    `setting`: auto | mm_t | linear | c (None: $MMSERVE_CPU_LINEAR, else auto). auto measures on the
    CPU, once per machine, torch, dtype, thread count and weight shapes (cached under `cache_dir()`)."""
    setting = (setting or os.environ.get(ENV, "").strip() or "auto").lower()
    if setting not in (*PATHS, "auto"):
        raise ValueError(f"{ENV}={setting!r}: choose from auto, {', '.join(PATHS)}")
    if setting == "c" and load() is None:
        raise ValueError(f"{ENV}=c, but the C kernel could not be built (see the log)")
    if setting != "auto":
        return LinearPaths.uniform(setting)
    if torch.device(device).type != "cpu" or not weights:
        return BLAS_PATHS
    dtype = weights[0][0].dtype
    candidates = [p for p in PATHS if p != "c" or (load() is not None and dtype in _C_DTYPES)]
    timed = _measured_subset(weights)
    key = _cache_key(timed, candidates)
    cached = _read_cache().get(key)
    if cached is not None:
        try:
            return LinearPaths(tuple(cached["paths"]))
        except (KeyError, TypeError, ValueError):
            pass  # a stale or damaged entry: measure again
    start = time.perf_counter()
    paths, ms, stable = _measure(timed, candidates)
    chosen = LinearPaths(paths)
    log.info("CPU linear paths measured in %.1f s: %s", time.perf_counter() - start, chosen.describe())
    if stable:
        _write_cache(key, {"paths": list(paths), "candidates": candidates, "ms_per_pass": ms})
    else:
        log.warning("the CPU linear paths were measured beside other work on these cores: not cached")
    return chosen


def _measured_subset(
    weights: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The first layers' weights, up to _MEASURE_BYTES (at least one)."""
    timed, total = [], 0
    for weight, bias in weights:
        if timed and total + weight.numel() * weight.element_size() > _MEASURE_BYTES:
            break
        timed.append((weight, bias))
        total += weight.numel() * weight.element_size()
    return timed


def _measure(
    weights: list[tuple[torch.Tensor, torch.Tensor | None]], candidates: list[str]
) -> tuple[tuple[str, ...], dict[str, list[float]], bool]:
    """Per row bucket, the candidate whose pass over `weights` is fastest; per row count, each candidate's
    fastest pass in ms; and whether the passes were stable (see _STABLE_SPREAD)."""
    dtype = weights[0][0].dtype
    generator = torch.Generator().manual_seed(0)
    chosen, ms, stable = [], {}, True
    with torch.inference_mode():
        for rows in ROW_BUCKETS:
            xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=generator).to(dtype) for w, _ in weights}
            passes: dict[str, list[float]] = {path: [] for path in candidates}
            for round_ in range(_MEASURE_ROUNDS + 1):  # the first round warms up (allocations, page faults)
                for path in candidates:  # interleaved: a slow spell of the machine hits every path alike
                    product = _PRODUCTS[path]
                    start = time.perf_counter()
                    for weight, bias in weights:
                        product(xs[weight.shape[1]], weight, bias)
                    if round_:
                        passes[path].append(time.perf_counter() - start)
            best = {path: min(times) for path, times in passes.items()}
            chosen.append(min(candidates, key=best.__getitem__))
            ms[str(rows)] = [round(best[p] * 1e3, 3) for p in candidates]
            stable &= all(min(t) < 1e-3 or max(t) <= _STABLE_SPREAD * min(t) for t in passes.values())
    return tuple(chosen), ms, stable


def _cache_key(weights: list[tuple[torch.Tensor, torch.Tensor | None]], candidates: list[str]) -> str:
    shapes = [(tuple(w.shape), b is not None) for w, b in weights]
    kernel = _KERNEL.source.read_bytes() if "c" in candidates else b""
    facts = [cpu_fingerprint(), torch.__version__, str(weights[0][0].dtype), torch.get_num_threads(), shapes, candidates,
             list(_KERNEL.cflags)]  # fmt: skip
    return hashlib.sha256(json.dumps(facts).encode() + kernel).hexdigest()[:24]


def _cache_file() -> Path:
    return cache_dir() / "cpu-linear-paths.json"


def _read_cache() -> dict[str, dict]:
    try:
        with open(_cache_file()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, entry: dict) -> None:
    """Adds one entry; written beside the file and renamed into place (a racing writer may drop an entry,
    which is then measured again)."""
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache()
        data[key] = entry
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not cache the measured CPU linear paths in %s: %s", path, exc)
