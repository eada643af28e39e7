"""Triton twin of `quant.w4a16_linear`: a linear layer over packed int4 weights (per-group scales, optional
zero points) and 16-bit or fp32 activations, dequantizing each weight tile in registers on its way into
`tl.dot`. Knows the packed layout (`quant`'s docstring), not checkpoint formats or the model."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from mmserve.kernels import quant


@triton.jit
def _w4a16_kernel(
    x_ptr,  # [M, K] activations, any strides
    qweight_ptr,  # [N, K // 8] int32: nibble j of word i holds column 8i + j, unsigned
    scales_ptr,  # [N, K // group_size] float
    zeros_ptr,  # [N, K // group_size] unsigned integer zero points; read only when HAS_ZEROS (else 8)
    bias_ptr,  # [N] float; read only when HAS_BIAS, by the programs of the first K split
    out_ptr,  # [num_splits, M, N]: x's dtype when unsplit (num_splits = 1), else fp32 partial sums
    M,
    N,
    K,  # a multiple of 8
    group_size,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_qk,
    stride_sn,
    stride_sg,
    stride_zn,
    stride_zg,
    stride_os,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a power of two >= 16 (so a multiple of 8: whole words)
    GROUP_K: tl.constexpr,  # BLOCK_K divides group_size: one scale (and zero) per row per K step
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 operands in exact ("ieee", not tf32) dots: fp32 and the interpreter
):
    # Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), num_splits). The M tiles vary fastest, so the programs that
    # share a weight tile run together and read it from memory once. A program owns out[rows, cols] of its
    # split and the split's share of the K steps: out = x[rows, k] @ W[cols, k]^T, accumulated in fp32.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    num_steps = tl.cdiv(K, BLOCK_K)
    steps_per_split = tl.cdiv(num_steps, tl.num_programs(2))
    first_step = pid_k * steps_per_split
    last_step = tl.minimum(num_steps, first_step + steps_per_split)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_word = tl.arange(0, BLOCK_K // 8)
    shifts = (offs_k % 8) * 4  # [BLOCK_K] bit of column k's nibble in its word
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    q_rows = qweight_ptr + offs_n.to(tl.int64)[:, None] * stride_qn  # [BLOCK_N, 1]
    s_rows = scales_ptr + offs_n.to(tl.int64) * stride_sn  # [BLOCK_N]
    z_rows = zeros_ptr + offs_n.to(tl.int64) * stride_zn  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(first_step, last_step):
        k0 = step * BLOCK_K
        k = k0 + offs_k  # [BLOCK_K]
        k_ok = k < K
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # Each word once: [BLOCK_N, BLOCK_K // 8], then every word repeated 8 times along K -> [BLOCK_N, BLOCK_K]
        # (column c holds word c // 8), and column c keeps its own nibble.
        word = k0 // 8 + offs_word
        words = tl.load(
            q_rows + word[None, :] * stride_qk, mask=n_ok[:, None] & (word < K // 8)[None, :], other=0
        )
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        q = (words >> shifts[None, :]) & 0xF  # [BLOCK_N, BLOCK_K] int32 0..15 (the mask drops sign bits)
        if GROUP_K:
            group = k0 // group_size
            scale = tl.load(s_rows + group * stride_sg, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            if HAS_ZEROS:
                zero = tl.load(z_rows + group * stride_zg, mask=n_ok, other=0).to(tl.int32)[:, None]
            else:
                zero = 8
        else:
            group = k // group_size  # [BLOCK_K]
            gk = n_ok[:, None] & k_ok[None, :]
            scale = tl.load(s_rows[:, None] + group[None, :] * stride_sg, mask=gk, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                zero = tl.load(z_rows[:, None] + group[None, :] * stride_zg, mask=gk, other=0).to(tl.int32)
            else:
                zero = 8
        w = (q - zero).to(tl.float32) * scale  # [BLOCK_N, BLOCK_K] as the reference: exact for 16-bit scales
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    if HAS_BIAS:  # added by the first K split only
        bias_cols = tl.where(pid_k == 0, N, 0)
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < bias_cols, other=0.0)  # [BLOCK_N]
        acc += bias.to(tl.float32)[None, :]
    dst = out_ptr + pid_k * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# Under TRITON_INTERPRET=1 (read when a kernel is decorated) the kernel runs on CPU tensors in the interpreter.
INTERPRETED: bool = not isinstance(_w4a16_kernel, JITFunction)
# As triton_attention.CONSISTENT: triton's own library was decorated the same way as this kernel.
CONSISTENT: bool = isinstance(tl.zeros, JITFunction) != INTERPRETED

# Split K when the output tiles fill fewer than this many programs per SM, keeping >= _MIN_SPLIT_STEPS K
# steps per split and at most _MAX_SPLITS splits (decode of a layer with few output columns). Untuned.
_SPLIT_PROGRAMS_PER_SM = 1
_MIN_SPLIT_STEPS = 4
_MAX_SPLITS = 8


@dataclass(frozen=True)
class W4A16TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_splits: int  # K splits; > 1 sums fp32 partials [num_splits, M, N] after the launch
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int | None:
    if device.type != "cuda" or INTERPRETED:
        return None  # the interpreter runs programs one by one: splitting only costs time there
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_config(
    m: int, n: int, k: int, group_size: int, exact_fp32: bool, num_sms: int | None
) -> W4A16TileConfig:
    """Per-launch tiles: a 16-row tile for decode batches (the smallest `tl.dot` M: weights are read once
    whatever the batch, so wider rows only waste work), 32 and 64-row ones as M grows; a K step that fits in
    one quantization group where the group allows it (one scale load per row per step); K split when the
    output tiles leave SMs idle. Exact fp32 dots take smaller tiles (registers). Untuned guesses: tune with
    a GPU bench, not here."""
    if INTERPRETED:
        # The interpreter pays per program and op: few, large steps.
        block_m = min(64, max(16, triton.next_power_of_2(m)))
        return W4A16TileConfig(block_m, 64, _fit_block_k(128, group_size), 1, 4, 1)
    if exact_fp32:
        block_m, block_n, block_k, warps, stages = (16, 32, 32, 4, 3) if m <= 16 else (32, 64, 32, 8, 3)
    elif m <= 16:
        block_m, block_n, block_k, warps, stages = 16, 64, 128, 4, 4
    elif m <= 32:
        block_m, block_n, block_k, warps, stages = 32, 64, 128, 4, 4
    elif m <= 64:
        block_m, block_n, block_k, warps, stages = 64, 64, 64, 4, 4
    else:
        block_m, block_n, block_k, warps, stages = 64, 128, 64, 8, 3
    block_k = _fit_block_k(block_k, group_size)
    splits = 1
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if num_sms and tiles < _SPLIT_PROGRAMS_PER_SM * num_sms:
        steps = triton.cdiv(k, block_k)
        splits = min(_MAX_SPLITS, _SPLIT_PROGRAMS_PER_SM * num_sms // tiles, steps // _MIN_SPLIT_STEPS)
        splits = max(1, 1 << (max(1, splits).bit_length() - 1))  # a power of two
    return W4A16TileConfig(block_m, block_n, block_k, splits, warps, stages)


def _fit_block_k(block_k: int, group_size: int) -> int:
    """The largest power of two >= 16 and <= block_k that divides group_size (each K step then lies in one
    group); block_k itself where none does (groups not a multiple of 16: per-column scale loads)."""
    fit = block_k
    while fit >= 16 and group_size % fit:
        fit //= 2
    return fit if fit >= 16 else block_k


def _exact_fp32(x: torch.Tensor) -> bool:
    """fp32 operands in "ieee" dots: fp32 activations, and always in the interpreter (its bf16 tl.dot is wrong)."""
    return INTERPRETED or x.dtype == torch.float32


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (fp32 / fp16 / bf16) @ dequantize_w4(qweight, scales, zeros, group_size)^T + bias -> [M, N]
    in x's dtype; the arguments as `quant.w4a16_linear`'s (any strides), ValueError on the same shapes.
    Each weight is (q - zero) * scale in fp32, rounded to x's dtype for the dot (fp32 kept for fp32 x and
    in the interpreter); the dot accumulates in fp32, adds the bias and rounds once."""
    n, k, _ = quant.check_w4a16(x, qweight, scales, zeros, group_size, bias)
    tiles = tile_config(x.shape[0], n, k, group_size, _exact_fp32(x), _num_sms(x.device))
    return w4a16_linear_with(x, qweight, scales, zeros, group_size, bias, tiles=tiles)


def w4a16_linear_with(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    tiles: W4A16TileConfig,
) -> torch.Tensor:
    """`w4a16_linear` with the tiles given (tests and benchmarks: forced K splits, K steps that span
    groups). block_k must be a power of two >= 16."""
    n, k, _ = quant.check_w4a16(x, qweight, scales, zeros, group_size, bias)
    if tiles.block_k < 16 or tiles.block_k & (tiles.block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {tiles.block_k}")
    m = x.shape[0]
    if m == 0 or n == 0:
        return x.new_zeros(m, n)
    splits = max(1, min(tiles.num_splits, triton.cdiv(k, tiles.block_k)))
    if splits == 1:
        out = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    zero_arg = scales if zeros is None else zeros  # a placeholder pointer when there are no zero points
    zero_strides = (0, 0) if zeros is None else zeros.stride()
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), splits)
    _w4a16_kernel[grid](
        x,
        qweight,
        scales,
        zero_arg,
        scales if bias is None else bias,
        out,
        m,
        n,
        k,
        group_size,
        *x.stride(),
        *qweight.stride(),
        *scales.stride(),
        *zero_strides,
        *out.stride(),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        GROUP_K=group_size % tiles.block_k == 0,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        DOT_FP32=_exact_fp32(x),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if splits == 1:
        return out[0]
    return out.sum(dim=0).to(x.dtype)  # [M, N]: the fp32 partials added, rounded once
