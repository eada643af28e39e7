"""The W4A16 linear layer: the torch reference (`quant`) against a dequantize-then-matmul written out here, the
packed layout and its shape errors; the Triton kernel against the reference (in Triton's interpreter without
CUDA: tiny shapes); and the kernel compiled to cubins for sm_90 and sm_80 at the launches the engine makes
for real model shapes, without a GPU (the approach of test_triton_compile)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _kernels_runnable_here() -> bool:
    """As in test_moe_kernels: natively on CUDA, else in Triton's interpreter, which needs TRITON_INTERPRET=1
    before the first `import triton`; a process that imported triton compiled (the full suite, or the compile
    subprocess below, which imports triton first on purpose) leaves the env alone."""
    if not HAS_TRITON:
        return False
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    from mmserve.kernels import triton_w4a16

    return triton_w4a16.CONSISTENT and (triton_w4a16.INTERPRETED or torch.cuda.is_available())


IN_PROCESS = _kernels_runnable_here()

from mmserve.kernels import quant  # noqa: E402

if IN_PROCESS:
    from mmserve.kernels import triton_w4a16

triton_here = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton missing, or imported compiled: run by test_triton_kernel_in_a_fresh_interpreter_process",
)
DEVICE = torch.device("cuda" if IN_PROCESS and not triton_w4a16.INTERPRETED else "cpu")
# The interpreter's bf16 tl.dot is wrong (the kernel dots in fp32 there): bf16 is checked natively only.
TRITON_DTYPES = [torch.float32, torch.float16] + ([] if DEVICE.type == "cpu" else [torch.bfloat16])
# Max |error| over max |expected|: fp32 sums in other orders; 16-bit dtypes round weights and outputs.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def make_layer(
    n: int, k: int, group_size: int, dtype: torch.dtype, symmetric: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(q [N, K] int64 codes 0..15, scales [N, G] in dtype, zeros [N, G] uint8 or None, bias [N] in dtype)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // group_size, generator=gen) * 0.02 + 0.002).to(dtype)
    zeros = None if symmetric else torch.randint(0, 16, (n, k // group_size), generator=gen).to(torch.uint8)
    bias = torch.randn(n, generator=gen).to(dtype)
    return q, scales, zeros, bias


def plain_w4a16(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The layout's definition, element by element in float64: weight[n, k] = (q[n, k] - zero[n, k // g]) *
    scale[n, k // g]; out = x @ weight^T + bias."""
    group = torch.arange(q.shape[1]) // group_size  # [K] group of each column
    zero = torch.full_like(q, 8) if zeros is None else zeros.long()[:, group]
    weight = (q - zero).double() * scales.double()[:, group]  # [N, K]
    out = x.double() @ weight.T
    return out if bias is None else out + bias.double()


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = expected.double().abs().max().clamp_min(1e-30)
    err = float((out.double() - expected.double()).abs().max() / scale)
    assert err <= TOLERANCE[dtype], (
        f"max error {err:.2e} of max |expected| (tolerance {TOLERANCE[dtype]:.0e})"
    )


# ---------------------------------------------------------------------------------------------------------
# The torch reference.


def test_pack_layout_nibble_j_of_word_i_is_column_8i_plus_j() -> None:
    q = torch.tensor(
        [[0, 1, 2, 3, 4, 5, 6, 7, 15, 15, 15, 15, 15, 15, 15, 15], [8, 0, 0, 0, 0, 0, 0, 1] + [0] * 8]
    )
    qweight = quant.pack_w4(q)
    assert qweight.dtype == torch.int32 and qweight.shape == (2, 2)
    assert qweight.tolist() == [[0x76543210, -1], [0x10000008, 0]]  # 0xFFFFFFFF is -1 as int32
    assert torch.equal(quant.unpack_w4(qweight), q.to(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_pack_unpack_round_trip(dtype: torch.dtype) -> None:
    q = torch.randint(0, 16, (37, 96), generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(quant.unpack_w4(quant.pack_w4(q)), q.to(torch.uint8))
    qweight = quant.pack_w4(q)
    assert torch.equal(quant.pack_w4(quant.unpack_w4(qweight)), qweight)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_is_exact(symmetric: bool, dtype: torch.dtype) -> None:
    """(q - zero) * scale is exact in fp32 for 16-bit scales and rounds once for fp32 ones: bit-equal to the
    float64 definition rounded to the dtype."""
    q, scales, zeros, _ = make_layer(24, 128, 32, dtype, symmetric)
    weight = quant.dequantize_w4(quant.pack_w4(q), scales, zeros, 32, dtype)
    group = torch.arange(128) // 32
    zero = 8 if zeros is None else zeros.long()[:, group]
    assert torch.equal(weight, ((q - zero).double() * scales.double()[:, group]).to(dtype))


# group sizes: the common ones, one group per row (per-channel), and 8 / 4 (a group within one word: the
# reference's dequantize-everything path).
GROUP_SIZES = [32, 64, 128, 256, 8, 4]


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zeros"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_reference_matches_the_definition(
    m: int, dtype: torch.dtype, symmetric: bool, group_size: int
) -> None:
    n, k = 40, 256
    q, scales, zeros, bias = make_layer(n, k, group_size, dtype, symmetric, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    qweight = quant.pack_w4(q)
    for b in (bias, None):
        out = quant.w4a16_linear(x, qweight, scales, zeros, group_size, b)
        assert out.shape == (m, n) and out.dtype == dtype
        assert_close(out, plain_w4a16(x, q, scales, zeros, group_size, b), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_over_several_row_chunks_and_fp32_scales(dtype: torch.dtype) -> None:
    """N spans several of the fast path's row chunks (the last one short); scales in fp32 under 16-bit x;
    int32 zero points."""
    n, k, group_size = 1100, 1024, 128
    assert n * k > 2 * quant._CHUNK_ELEMENTS
    q, scales, zeros, bias = make_layer(n, k, group_size, torch.float32, symmetric=False)
    zeros = zeros.to(torch.int32)
    qweight = quant.pack_w4(q)
    for m in (3, 33):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        out = quant.w4a16_linear(x, qweight, scales, zeros, group_size, bias.to(dtype))
        assert_close(out, plain_w4a16(x, q, scales, zeros, group_size, bias.to(dtype)), dtype)


def test_reference_takes_strided_inputs() -> None:
    n, k, group_size = 24, 128, 32
    q, scales, zeros, bias = make_layer(n, k, group_size, torch.float32, symmetric=False)
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(5, 2 * k, generator=gen)
    x = wide[:, k:]  # [5, K], row stride 2K
    qweight = quant.pack_w4(q).t().contiguous().t()  # column-major [N, K // 8]
    scales_t = scales.t().contiguous().t()
    assert not x.is_contiguous() and not qweight.is_contiguous() and not scales_t.is_contiguous()
    out = quant.w4a16_linear(x, qweight, scales_t, zeros, group_size, bias)
    assert_close(out, plain_w4a16(x, q, scales, zeros, group_size, bias), torch.float32)


def test_reference_without_rows() -> None:
    q, scales, zeros, bias = make_layer(16, 64, 32, torch.bfloat16, symmetric=True)
    out = quant.w4a16_linear(
        torch.empty(0, 64, dtype=torch.bfloat16), quant.pack_w4(q), scales, zeros, 32, bias
    )
    assert out.shape == (0, 16) and out.dtype == torch.bfloat16


def _bad_calls() -> list[tuple[str, dict, str]]:
    """(id, overrides of a good call's arguments, the error's message pattern)."""
    n, k, g = 16, 64, 32
    good_q = torch.zeros(n, k // 8, dtype=torch.int32)
    return [
        ("x-1d", dict(x=torch.zeros(k)), "x must be"),
        ("x-int", dict(x=torch.zeros(1, k, dtype=torch.int32)), "x must be"),
        (
            "k-not-8",
            dict(x=torch.zeros(1, 60), qweight=torch.zeros(n, 7, dtype=torch.int32)),
            "divisible by 8",
        ),
        (
            "qweight-cols",
            dict(qweight=torch.zeros(n, k // 4, dtype=torch.int32)),
            r"qweight must be \[N, K // 8\]",
        ),
        ("qweight-dtype", dict(qweight=good_q.long()), "qweight must be int32"),
        ("group-not-dividing", dict(group_size=48), "group_size must be"),
        ("group-zero", dict(group_size=0), "group_size must be"),
        ("group-bool", dict(group_size=True), "group_size must be"),
        ("scales-shape", dict(scales=torch.ones(n, k // g + 1)), "scales must be"),
        ("scales-int", dict(scales=torch.ones(n, k // g, dtype=torch.int32)), "scales must be"),
        ("zeros-shape", dict(zeros=torch.zeros(n - 1, k // g, dtype=torch.uint8)), "zeros must be"),
        ("zeros-float", dict(zeros=torch.zeros(n, k // g)), "zeros must be"),
        ("bias-shape", dict(bias=torch.zeros(n + 1)), "bias must be"),
    ]


@pytest.mark.parametrize(
    ("overrides", "message"), [c[1:] for c in _bad_calls()], ids=[c[0] for c in _bad_calls()]
)
def test_reference_rejects_bad_shapes(overrides: dict, message: str) -> None:
    n, k, g = 16, 64, 32
    args = dict(
        x=torch.zeros(1, k),
        qweight=torch.zeros(n, k // 8, dtype=torch.int32),
        scales=torch.ones(n, k // g),
        zeros=torch.zeros(n, k // g, dtype=torch.uint8),
        group_size=g,
        bias=torch.zeros(n),
    )
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        quant.w4a16_linear(**args)
    if IN_PROCESS:  # the twin validates the same way, before launching anything
        with pytest.raises(ValueError, match=message):
            triton_w4a16.w4a16_linear(**args)


def test_pack_rejects_bad_codes() -> None:
    with pytest.raises(ValueError, match=r"0\.\.15"):
        quant.pack_w4(torch.full((2, 8), 16))
    with pytest.raises(ValueError, match=r"0\.\.15"):
        quant.pack_w4(torch.full((2, 8), -1))
    with pytest.raises(ValueError, match="divisible by 8"):
        quant.pack_w4(torch.zeros(2, 12, dtype=torch.int32))
    with pytest.raises(ValueError, match="integer"):
        quant.pack_w4(torch.zeros(2, 8))


# ---------------------------------------------------------------------------------------------------------
# The Triton kernel against the reference (interpreter: tiny shapes, about a second in all).

# (m, n, k, group_size): decode rows, a ragged M and N (not multiples of the tiles), one group per row, and
# groups of 8 (smaller than any K step: per-column scale loads).
TRITON_CASES = [(1, 48, 128, 32), (7, 40, 256, 128), (20, 33, 128, 128), (3, 16, 64, 8)]


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zeros"])
@pytest.mark.parametrize(("m", "n", "k", "group_size"), TRITON_CASES)
def test_triton_kernel_matches_reference(
    m: int, n: int, k: int, group_size: int, symmetric: bool, dtype: torch.dtype
) -> None:
    q, scales, zeros, bias = make_layer(n, k, group_size, dtype, symmetric, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    args = [t if t is None else t.to(DEVICE) for t in (x, quant.pack_w4(q), scales, zeros)]
    for b in (bias.to(DEVICE), None) if symmetric else (None,):
        out = triton_w4a16.w4a16_linear(*args, group_size, b)
        assert out.shape == (m, n) and out.dtype == dtype
        assert_close(out, quant.w4a16_linear(*args, group_size, b), dtype)


@triton_here
@pytest.mark.parametrize(
    ("block_k", "num_splits"),
    [(16, 3), (64, 2), (32, 1)],
    ids=["split-3-uneven", "steps-span-groups-split-2", "step-within-group"],
)
def test_triton_kernel_tilings(block_k: int, num_splits: int) -> None:
    """Forced tiles: K split in uneven shares (bias added once), K steps wider than a group of 32, strided
    inputs (x a slice of a wider tensor, column-major qweight and scales), int32 zero points."""
    m, n, k, group_size = 5, 24, 256, 32
    q, scales, zeros, bias = make_layer(n, k, group_size, torch.float16, symmetric=False, seed=7)
    wide = torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(8)).half().to(DEVICE)
    x = wide[:, :k]
    qweight = quant.pack_w4(q).t().contiguous().t().to(DEVICE)
    scales = scales.t().contiguous().t().to(DEVICE)
    zeros, bias = zeros.to(torch.int32).to(DEVICE), bias.to(DEVICE)
    assert not x.is_contiguous() and not qweight.is_contiguous() and not scales.is_contiguous()
    tiles = triton_w4a16.W4A16TileConfig(16, 16, block_k, num_splits, 4, 1)
    out = triton_w4a16.w4a16_linear_with(x, qweight, scales, zeros, group_size, bias, tiles=tiles)
    assert_close(out, quant.w4a16_linear(x, qweight, scales, zeros, group_size, bias), torch.float16)


@triton_here
def test_triton_kernel_without_rows() -> None:
    q, scales, _, _ = make_layer(16, 64, 32, torch.float32, symmetric=True)
    x = torch.empty(0, 64, device=DEVICE)
    out = triton_w4a16.w4a16_linear(x, quant.pack_w4(q).to(DEVICE), scales.to(DEVICE), None, 32, None)
    assert out.shape == (0, 16)


@triton_here
def test_triton_kernel_tile_choice_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU rules (this process may be interpreting): decode and prefill tiles, K steps fitted to the
    group, K split only when the output tiles leave SMs idle."""
    monkeypatch.setattr(triton_w4a16, "INTERPRETED", False)
    config = triton_w4a16.tile_config
    decode = config(1, 4096, 4096, 128, False, 132)
    assert (decode.block_m, decode.block_k) == (16, 128) and decode.num_splits == 2  # 64 tiles on 132 SMs
    assert config(1, 37888, 3584, 128, False, 132).num_splits == 1  # 592 tiles
    assert config(1, 4096, 4096, 128, False, None).num_splits == 1  # no SM count: never split
    assert config(512, 4096, 4096, 128, False, 132).block_m == 64
    assert config(1, 4096, 4096, 32, False, 132).block_k == 32
    assert config(1, 4096, 4096, 48, False, 132).block_k == 16
    assert config(1, 4096, 4096, 8, False, 132).block_k == 128  # no power of two >= 16 divides 8
    assert config(1, 64, 128, 128, False, 132).num_splits == 1  # 1 K step: nothing to split


@pytest.mark.skipif(IN_PROCESS or not HAS_TRITON, reason="the Triton kernel runs in this process")
def test_triton_kernel_in_a_fresh_interpreter_process() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "triton_kernel and not fresh",
    ]
    done = subprocess.run(
        [*cmd, str(Path(__file__).resolve())],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout


# ---------------------------------------------------------------------------------------------------------
# The kernel compiled for sm_90 and sm_80 without a GPU, at the launches `triton_w4a16.w4a16_linear` makes.
# As test_triton_compile: a fresh process without TRITON_INTERPRET (it imports triton before this module,
# so `_kernels_runnable_here` leaves the env alone) swaps the kernel for a recorder, calls the entry point on
# CPU tensors shaped as a model's layers, and compiles each distinct launch with triton's own binder and
# `triton.compile(ASTSource(...), target=GPUTarget(...))` through ptxas; `ptxas -v` reports spills.

ARCHS = {90: 132, 80: 108}  # compute capability -> SM count the K-split rule plans with (H100/H200, A100)
# (name, hidden, intermediate, num_heads, num_kv_heads, head_dim) from the Hugging Face configs.
MODELS = (("qwen2-vl-2b", 1536, 8960, 12, 2, 128), ("qwen2-vl-7b", 3584, 18944, 28, 4, 128))
# (name, group_size, zero points): GPTQ-style symmetric and AWQ-style asymmetric, both with groups of 128.
SCHEMES = (("sym-g128", 128, False), ("asym-g128", 128, True))
COMPILE_DTYPES = ("bfloat16", "float16")
ROWS = {"decode": 8, "prefill": 512}


def _layers(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """layer -> (N, K, bias) of a Qwen2 decoder layer (q/k/v fused, gate/up fused)."""
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden, True),
        "o": (hidden, heads * head_dim, False),
        "gate_up": (2 * intermediate, hidden, False),
        "down": (hidden, intermediate, False),
    }


def _compile_cases() -> list[dict]:
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    cases = [
        dict(
            id=f"{model[0]}-{scheme}-{short[dtype]}",
            model=model,
            group_size=g,
            zeros=z,
            dtype=dtype,
            rows=ROWS,
        )
        for model in MODELS
        for scheme, g, z in SCHEMES
        for dtype in COMPILE_DTYPES
    ]
    # Groups of 32 (the K step shrinks to a group), the middle M tiles, and fp32's exact dots.
    cases.append(
        dict(
            id="qwen2-vl-2b-asym-g32-bf16",
            model=MODELS[0],
            group_size=32,
            zeros=True,
            dtype="bfloat16",
            rows=ROWS,
        )
    )
    cases.append(
        dict(
            id="qwen2-vl-2b-asym-g128-bf16-m32-m64",
            model=MODELS[0],
            group_size=128,
            zeros=True,
            dtype="bfloat16",
            rows={"m32": 32, "m64": 64},
        )
    )
    cases.append(
        dict(
            id="qwen2-vl-2b-sym-g128-fp32",
            model=MODELS[0],
            group_size=128,
            zeros=False,
            dtype="float32",
            rows=ROWS,
        )
    )
    return cases


COMPILE_CASES = _compile_cases()


class _Recorder:
    """Stands in for the kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def _record_launches(case: dict, num_sms: int) -> list[tuple[str, str, tuple, tuple, dict]]:
    """(layer, rows name, grid, args, kwargs) of every launch the entry point makes for the case's layers."""
    from mmserve.kernels import triton_w4a16 as tw

    kernel, num_sms_fn = tw._w4a16_kernel, tw._num_sms
    launches: list = []
    out = []
    try:
        tw._w4a16_kernel = _Recorder(kernel, launches)
        tw._num_sms = lambda device: num_sms
        dtype = getattr(torch, case["dtype"])
        g = case["group_size"]
        for layer, (n, k, has_bias) in _layers(*case["model"][1:]).items():
            # As a loader makes them (torch.empty only reserves address space: nothing touches it).
            qweight = torch.empty(n, k // 8, dtype=torch.int32)
            scales = torch.empty(n, k // g, dtype=dtype)
            zeros = torch.empty(n, k // g, dtype=torch.uint8) if case["zeros"] else None
            bias = torch.empty(n, dtype=dtype) if has_bias else None
            for rows_name, m in case["rows"].items():
                tw.w4a16_linear(torch.empty(m, k, dtype=dtype), qweight, scales, zeros, g, bias)
                out += [(layer, rows_name, *launch) for launch in launches]
                launches.clear()
    finally:
        tw._w4a16_kernel, tw._num_sms = kernel, num_sms_fn
    return out


def _specialize(kernel, args: tuple, kwargs: dict, target):
    """What `JITFunction.run` hands `triton.compile` for these arguments (triton's own binder and packing)."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound_args, specialization, options)


_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


class _ThreadStdout(io.TextIOBase):
    """sys.stdout while compiling: each thread's writes (ptxas's log) go to its own buffer."""

    def __init__(self) -> None:
        self.local = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not hasattr(self.local, "buf"):
            self.local.buf = io.StringIO()
        return self.local.buf.write(text)

    def take(self) -> str:
        text = self.local.buf.getvalue() if hasattr(self.local, "buf") else ""
        self.local.buf = io.StringIO()
        return text


def _compile_one(kernel, signature, constexprs, attrs, options, target, log: _ThreadStdout) -> dict:
    import triton
    from triton.compiler import ASTSource

    began = time.perf_counter()
    log.take()
    try:
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__
        )
    except Exception as e:
        return dict(ok=False, error=f"{type(e).__name__}: {e}"[-4000:])
    spills = _SPILLS.search(log.take())  # TRITON_DUMP_PTXAS_LOG=1 prints `ptxas -v` to stdout
    return dict(
        ok=True,
        seconds=time.perf_counter() - began,
        stages=sorted(compiled.asm),
        cubin_bytes=len(compiled.asm.get("cubin", b"")),
        ptx_bytes=len(compiled.asm.get("ptx", "")),
        spill_bytes=int(spills[1]) + int(spills[2]) if spills else None,
    )


def _compile_main(out_path: str) -> None:
    """The compile subprocess: every case's launches on both archs, each distinct one compiled once (keyed
    by the constexprs, pointer dtypes and launch options; the first launch met of a key is compiled)."""
    assert "TRITON_INTERPRET" not in os.environ
    from triton.backends.compiler import GPUTarget

    from mmserve.kernels import triton_w4a16 as tw

    start = time.perf_counter()
    kernel = tw._w4a16_kernel
    constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
    launches: dict[str, list[dict]] = {}
    todo: dict[str, tuple] = {}
    for case in COMPILE_CASES:
        launches[case["id"]] = []
        for arch, num_sms in ARCHS.items():
            target = GPUTarget("cuda", arch, 32)  # CUDA warps are 32 threads
            for layer, rows, grid, args, kwargs in _record_launches(case, num_sms):
                options, signature, constexprs, attrs = _specialize(kernel, args, kwargs, target)
                names = kernel.arg_names
                values = {names[i[0]]: v for i, v in constexprs.items() if names[i[0]] in constexpr_names}
                pointers = {k: v for k, v in signature.items() if v.startswith("*")}
                key = repr((arch, sorted(values.items()), sorted(pointers.items()), options))
                launches[case["id"]].append(
                    dict(layer=layer, rows=rows, arch=arch, grid=list(grid), key=key, **values)
                )
                todo.setdefault(key, (kernel, signature, constexprs, attrs, options, target))
    log = _ThreadStdout()
    # Threads: ptxas runs as a subprocess and much of MLIR's work releases the GIL.
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool, contextlib.redirect_stdout(log):
        futures = {key: pool.submit(_compile_one, *job, log) for key, job in todo.items()}
        results = {key: future.result() for key, future in futures.items()}
    report = dict(
        interpreted=tw.INTERPRETED, launches=launches, results=results, seconds=time.perf_counter() - start
    )
    Path(out_path).write_text(json.dumps(report))


@pytest.fixture(scope="module")
def compile_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Runs the compile subprocess once for every case; its JSON report."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    tmp = tmp_path_factory.mktemp("w4a16-compile")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "cache")  # a cold cache: every kernel is really compiled, ptxas runs
    env["TRITON_DUMP_PTXAS_LOG"] = "1"
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), str(root), env.get("PYTHONPATH", "")])
    code = f"import sys, triton, {Path(__file__).stem} as t; t._compile_main(sys.argv[1])"
    out_path = tmp / "report.json"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"compile subprocess failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out_path.read_text())


def test_compiled_launch_values_are_the_gpu_ones(compile_report: dict) -> None:
    assert compile_report["interpreted"] is False
    print(f"\n{len(compile_report['results'])} distinct W4A16 compiles in {compile_report['seconds']:.1f} s")


@pytest.mark.parametrize("case", COMPILE_CASES, ids=[c["id"] for c in COMPILE_CASES])
def test_w4a16_compiles_to_cubin(compile_report: dict, case: dict) -> None:
    failures = []
    for launch in compile_report["launches"][case["id"]]:
        result = compile_report["results"][launch["key"]]
        where = f"{launch['layer']} {launch['rows']} sm_{launch['arch']}"
        if not result["ok"]:
            failures.append(f"{where}: {result['error']}")
        elif not result["cubin_bytes"] or not result["ptx_bytes"]:
            failures.append(f"{where}: no cubin or ptx ({result['stages']})")
        elif result["spill_bytes"] is None or result["spill_bytes"]:
            failures.append(f"{where}: register spills {result['spill_bytes']} (None: no ptxas report)")
    assert not failures, "\n".join(dict.fromkeys(failures))


@pytest.mark.parametrize("case", COMPILE_CASES, ids=[c["id"] for c in COMPILE_CASES])
def test_w4a16_launches_fit_the_batch(compile_report: dict, case: dict) -> None:
    """Decode on the 16-row tile, prefill on the 64-row one; every layer launched on both archs; the K split
    only at decode and only where a layer's output tiles leave SMs idle."""
    launches = compile_report["launches"][case["id"]]
    assert len(launches) == len(ARCHS) * 4 * len(case["rows"])
    for launch in launches:
        if launch["rows"] == "decode":
            assert launch["BLOCK_M"] == 16
        if launch["rows"] == "prefill":
            assert launch["BLOCK_M"] == (32 if case["dtype"] == "float32" else 64)
            assert launch["grid"][2] == 1
        assert launch["GROUP_K"] and case["group_size"] % launch["BLOCK_K"] == 0
        assert launch["HAS_ZEROS"] == case["zeros"] and launch["HAS_BIAS"] == (launch["layer"] == "qkv")
        tiles = launch["grid"][0] * launch["grid"][1]
        assert launch["grid"][2] == 1 or tiles < ARCHS[launch["arch"]]


def test_w4a16_dispatch_defaults_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton on CUDA (where installed), the torch twin elsewhere; MMSERVE_W4A16_BACKEND overrides."""
    from mmserve.kernels.dispatch import get_w4a16_backend

    monkeypatch.delenv("MMSERVE_W4A16_BACKEND", raising=False)
    backend = get_w4a16_backend(torch.device("cpu"))
    assert backend.name == "torch" and backend.w4a16_linear is quant.w4a16_linear
    monkeypatch.setenv("MMSERVE_W4A16_BACKEND", "torch")
    assert get_w4a16_backend(torch.device("cuda")).w4a16_linear is quant.w4a16_linear
    monkeypatch.setenv("MMSERVE_W4A16_BACKEND", "marlin")
    with pytest.raises(ValueError, match="not available"):
        get_w4a16_backend(torch.device("cpu"))


@triton_here
def test_w4a16_dispatch_picks_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from mmserve.kernels.dispatch import get_w4a16_backend

    monkeypatch.setenv("MMSERVE_W4A16_BACKEND", "triton")
    backend = get_w4a16_backend(DEVICE)
    assert backend.name == "triton" and backend.w4a16_linear is triton_w4a16.w4a16_linear
    monkeypatch.delenv("MMSERVE_W4A16_BACKEND")
    if DEVICE.type == "cuda":
        assert get_w4a16_backend(DEVICE).name == "triton"
