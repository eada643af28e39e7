"""The W4A16 linear layer: the torch reference (`quant`) against a dequantize-then-matmul written out here, the
packed layout and its shape errors; the Triton kernel against the reference (in Triton's interpreter without
CUDA: tiny shapes); the dispatch. test_triton_compile compiles the kernel to cubins for sm_90 and sm_80 at the
launches the engine makes for real model shapes, without a GPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
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
