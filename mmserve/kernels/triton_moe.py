"""Triton twin of `moe.fused_moe`: the routed experts of a Mixture-of-Experts layer as two launches of one
grouped GEMM kernel over the (token, slot) pairs sorted and padded per expert (`moe.moe_align`), with a
silu-and-mul kernel between them. Knows expert weights and routing, not the model around them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from mmserve.kernels import moe


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [num_a_rows, K]: hidden [num_tokens, hidden] (row = pair // top_k) or activations [num_pairs, I]
    b_ptr,  # [num_experts, N, K] expert weights (F.linear layout), any strides
    c_ptr,  # [num_pairs, N] one output row per (token, slot) pair
    topk_weights_ptr,  # [num_pairs] routing weights, read only when MUL_ROUTED_WEIGHT
    sorted_token_ids_ptr,  # [max_padded] int32 pairs grouped by expert; padding rows hold num_pairs
    expert_ids_ptr,  # [max_padded // BLOCK_M] int32 expert of each BLOCK_M block of sorted rows
    num_tokens_post_padded_ptr,  # [1] int32 sorted rows in use; later blocks exit at once
    N,
    K,
    num_pairs,
    top_k,  # pairs per A row: top_k for the gate_up launch (A = hidden), 1 for down (A = activations)
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,  # sorted rows per program: moe_align's block, so a block has one expert
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,  # scale each row by its pair's routing weight (the down launch)
    DOT_FP32: tl.constexpr,  # fp32 operands in exact ("ieee", not tf32) dots: fp32 and the interpreter
):
    # Grid: (max_padded // BLOCK_M, cdiv(N, BLOCK_N)). A program owns BLOCK_M sorted rows of one expert and
    # BLOCK_N output columns: C[rows, cols] = A[rows gathered] @ B[expert, cols, :]^T, accumulated in fp32.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_token_ids_ptr + offs_m)  # [BLOCK_M] int32
    row_ok = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (pair // top_k).to(tl.int64)[:, None] * stride_am  # [BLOCK_M, 1]
    b_cols = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K]
        k_ok = k < K
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None] * stride_bk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_FP32:  # a: [BLOCK_M, BLOCK_K], b: [BLOCK_K, BLOCK_N]
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b.to(a.dtype))
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)  # [BLOCK_M]
        acc = acc * weight[:, None]
    tl.store(
        c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn,
        acc.to(c_ptr.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [num_rows, 2 * intermediate]: gate columns first, then up
    out_ptr,  # [num_rows, intermediate]
    num_rows,
    intermediate,
    stride_gm,
    stride_om,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    # Grid: (cdiv(num_rows, BLOCK_R), cdiv(intermediate, BLOCK_I)). silu(gate) * up in fp32, one rounding.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < num_rows)[:, None] & (cols < intermediate)[None, :]
    src = gate_up_ptr + rows.to(tl.int64)[:, None] * stride_gm + cols[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_I]
    up = tl.load(src + intermediate, mask=mask, other=0.0).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    dst = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(dst, act.to(out_ptr.dtype.element_ty), mask=mask)


# Under TRITON_INTERPRET=1 (read when a kernel is decorated) the kernels run on CPU tensors in the interpreter.
INTERPRETED: bool = not isinstance(_fused_moe_kernel, JITFunction)
# As triton_attention.CONSISTENT: triton's own library was decorated the same way as these kernels.
CONSISTENT: bool = isinstance(tl.zeros, JITFunction) != INTERPRETED


@dataclass(frozen=True)
class MoETileConfig:
    block_m: int  # sorted rows per program, and moe_align's padding per expert
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tile_config(num_tokens: int, num_experts: int, exact_fp32: bool) -> MoETileConfig:
    """Per-launch tile shape, vLLM's untuned defaults: a 16-row tile when experts get a few rows each
    (decode: padding each expert to 64 rows would waste most of the work), a 64-row one for prefills.
    Exact fp32 dots take smaller tiles (registers). Tune on a GPU with the bench, not here."""
    if INTERPRETED:
        return MoETileConfig(16, 64, 64, 4, 1)  # the interpreter pays per program and op: few, large steps
    small = num_tokens <= num_experts
    if exact_fp32:
        return MoETileConfig(16, 32, 32, 4, 2) if small else MoETileConfig(32, 64, 32, 4, 2)
    return MoETileConfig(16, 64, 64, 4, 3) if small else MoETileConfig(64, 64, 32, 4, 3)


def _exact_fp32(hidden: torch.Tensor) -> bool:
    """fp32 operands in "ieee" dots: fp32 batches, and always in the interpreter (its bf16 tl.dot is wrong)."""
    return INTERPRETED or hidden.dtype == torch.float32


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, k].

    hidden: [num_tokens, hidden]; w_gate_up: [num_experts, 2 * intermediate, hidden] (gate rows first);
    w_down: [num_experts, hidden, intermediate]; weights in hidden.dtype, any strides. topk_weights:
    [num_tokens, top_k]; topk_ids: [num_tokens, top_k] int64 in [0, num_experts). Returns
    [num_tokens, hidden] in hidden.dtype. GEMMs accumulate in fp32; the gate_up and activation buffers are in
    hidden.dtype; the sum over the top_k slots adds in fp32 and rounds once.
    """
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden_size = w_gate_up.shape
    intermediate = two_i // 2
    if num_tokens == 0:
        return hidden.new_zeros(0, hidden_size)
    num_pairs = num_tokens * top_k
    exact = _exact_fp32(hidden)
    tiles = tile_config(num_tokens, num_experts, exact)
    sorted_token_ids, expert_ids, num_tokens_post_padded = moe.moe_align(topk_ids, num_experts, tiles.block_m)
    routing = topk_weights.reshape(-1).contiguous()  # [num_pairs], pair = token * top_k + slot
    meta = (routing, sorted_token_ids, expert_ids, num_tokens_post_padded, num_pairs)

    gate_up = hidden.new_empty(num_pairs, two_i)  # [num_pairs, 2 * intermediate]
    _grouped_gemm(hidden, w_gate_up, gate_up, meta, top_k, False, exact, tiles)
    # A separate elementwise pass (not fused into the GEMM's epilogue): the gate and up columns of one row
    # live in different N tiles of the first launch. One read and one write of the buffer, vs three passes
    # for torch's silu then mul.
    act = hidden.new_empty(num_pairs, intermediate)  # [num_pairs, intermediate]
    block_r = triton.next_power_of_2(num_pairs) if INTERPRETED else 16
    block_i = min(triton.next_power_of_2(intermediate), 128 if INTERPRETED else 256)
    _silu_and_mul_kernel[(triton.cdiv(num_pairs, block_r), triton.cdiv(intermediate, block_i))](
        gate_up,
        act,
        num_pairs,
        intermediate,
        gate_up.stride(0),
        act.stride(0),
        BLOCK_R=block_r,
        BLOCK_I=block_i,
    )
    down = hidden.new_empty(num_pairs, hidden_size)  # [num_pairs, hidden], routing weight multiplied in
    _grouped_gemm(act, w_down, down, meta, 1, True, exact, tiles)
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1)  # [num_tokens, hidden]


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int],
    top_k: int,
    mul_routed_weight: bool,
    exact: bool,
    tiles: MoETileConfig,
) -> None:
    """c[pair] = a[pair // top_k] @ b[expert of pair]^T (times the pair's routing weight if asked)."""
    routing, sorted_token_ids, expert_ids, num_tokens_post_padded, num_pairs = meta
    _, n, k = b.shape
    grid = (sorted_token_ids.numel() // tiles.block_m, triton.cdiv(n, tiles.block_n))
    _fused_moe_kernel[grid](
        a,
        b,
        c,
        routing,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        n,
        k,
        num_pairs,
        top_k,
        *a.stride(),
        *b.stride(),
        *c.stride(),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        MUL_ROUTED_WEIGHT=mul_routed_weight,
        DOT_FP32=exact,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
