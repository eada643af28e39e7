"""The CPU attention backend: decode rows through a C kernel (`csrc/paged_decode_attention.c`) that
reads K/V straight from the cache blocks, everything else through the torch reference. The kernel is
compiled once per machine with the system C compiler and loaded with ctypes; `load()` returns None
where that is not possible, and dispatch then keeps the reference."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from mmserve.kernels import fp8, reference

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.c"
# -march=native: the library is built for, and cached per, the CPU it runs on (see _cache_key). -fopenmp
# links libgomp, which resolves to the copy torch already loaded where they share the soname (pip wheels):
# the kernel's threads are then torch's own pool, not a second one contending for the same cores.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
# Linked in a second step without -ffast-math: linking with it adds GCC's crtfastmath.o, whose constructor
# turns on flush-to-zero for the whole process when the library loads (every later torch op would see it).
LDFLAGS = ("-shared", "-fopenmp")

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# (query, kv_cache, byte_table, kv_scales, block_tables, table stride, seq_lens, rows, out, begin, end,
#  num_blocks, block_size, num_heads, num_kv_heads, head_dim, scale, num_threads)
_ARGTYPES = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64]  # fmt: skip
# FP8 cache dtype -> [256] fp32 value of each byte, made once
_byte_tables: dict[torch.dtype, torch.Tensor] = {}

_lock = threading.Lock()
_kernel: ctypes._CFuncPtr | None = None
_load_failed = False


def cache_dir() -> Path:
    """Where compiled kernels live: $MMSERVE_KERNEL_CACHE, else ~/.cache/mmserve/kernels."""
    env = os.environ.get("MMSERVE_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mmserve" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_key(compiler: str) -> str:
    """Source, flags, compiler and the CPU's feature flags: a shared home directory on machines with
    different CPUs must never load a library built for another one's instruction set."""
    cpu = platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu += next(line for line in lines if line.startswith(("flags", "Features")))  # x86, ARM
    except (OSError, StopIteration):
        cpu += platform.processor()
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS + LDFLAGS).encode(), compiler.encode(), cpu.encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def load() -> ctypes._CFuncPtr | None:
    """The compiled kernel, building it on first use; None (with one warning) where no C compiler works."""
    global _kernel, _load_failed
    if _kernel is not None or _load_failed:  # decided: no lock on the per-layer path
        return _kernel
    with _lock:
        if _kernel is not None or _load_failed:
            return _kernel
        compiler = _compiler()
        try:
            if compiler is None:
                raise RuntimeError("no C compiler found (set CC, or install gcc)")
            library = cache_dir() / f"paged_decode_attention-{_cache_key(compiler)}.so"
            if not library.exists():
                _compile(compiler, library)
            kernel = ctypes.CDLL(str(library)).paged_decode_attention
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _load_failed = True
            log.warning("CPU attention kernel unavailable, using the torch reference: %s", exc)
            return None
        kernel.argtypes, kernel.restype = _ARGTYPES, ctypes.c_int
        _kernel = kernel
        return kernel


def _compile(compiler: str, library: Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed into place, so processes compiling at once never load a
    # half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        for command in (
            [compiler, *CFLAGS, "-c", "-o", obj, str(SOURCE)],
            [compiler, *LDFLAGS, "-o", tmp, obj, "-lm"],
        ):
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, library)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and (kv_cache.dtype == torch.float32 or fp8.is_fp8(kv_cache.dtype))
        and kv_cache.is_contiguous()
        and query.shape[1] % kv_cache.shape[3] == 0
        and query.shape[1] <= 64  # MAX_HEADS in the C source
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """reference.paged_attention's contract. Decodes run in the C kernel on torch's intra-op thread count
    (an FP8 cache decoded through its byte table); prefill chunks and unsupported inputs (queries not fp32
    on the CPU) take the reference."""
    kernel = load()
    decodes = reference.decode_seqs(query_start_loc)
    if kernel is None or not decodes or not supports(query, kv_cache):
        args = (query, kv_cache, block_tables, query_start_loc, seq_lens, scale, kv_scales)
        return reference.paged_attention(*args)
    query = query.contiguous()
    out = torch.empty_like(query)
    tables = block_tables[decodes].to(torch.int64).contiguous()  # [num_decodes, max_blocks]
    lens_t = torch.tensor([seq_lens[i] for i in decodes], dtype=torch.int64)
    rows_t = torch.tensor([query_start_loc[i] for i in decodes], dtype=torch.int64)
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    table, scales = None, None
    if fp8.is_fp8(kv_cache.dtype):
        table = _byte_tables.setdefault(kv_cache.dtype, fp8.byte_table(kv_cache.dtype))
        scales = fp8.unit_scales(num_kv_heads) if kv_scales is None else kv_scales.float().contiguous()
    args = (query.data_ptr(), kv_cache.data_ptr(), _address(table), _address(scales), tables.data_ptr(),
            tables.stride(0), lens_t.data_ptr(), rows_t.data_ptr(), out.data_ptr())  # fmt: skip
    shape = (num_blocks, block_size, query.shape[1], num_kv_heads, head_dim, scale)
    code = kernel(*args, 0, len(decodes), *shape, torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"paged_decode_attention failed with code {code}")
    if len(decodes) < len(seq_lens):
        args = (out, query, kv_cache, block_tables, query_start_loc, seq_lens, scale, kv_scales)
        reference.prefill_attention(*args)
    return out


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
