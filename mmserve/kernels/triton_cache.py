"""Triton twin of `reference.store_kv_cache`: writes each new token's K/V into its paged-cache slot.
Knows the cache layout only ([2, num_blocks, block_size, num_kv_heads, head_dim]), not the model."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], any strides
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], any strides
    k_cache_ptr,  # kv_cache[0]: [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # kv_cache[1]: same strides as k_cache
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    num_tokens,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,  # a constant, so the d-mask folds away and accesses vectorize
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # next power of two >= num_kv_heads
    BLOCK_D: tl.constexpr,  # next power of two >= head_dim
):
    # Grid: (cdiv(num_tokens, BLOCK_T),). Each program copies the [BLOCK_T, num_kv_heads, head_dim] K and V tiles.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    slot = tl.load(slot_mapping_ptr + tokens, mask=t_ok, other=0)  # int64: cache offsets cannot overflow
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    t = tokens[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    mask = t_ok[:, None, None] & (h < num_kv_heads) & (d < HEAD_DIM)
    dst = (block * stride_cb + offset * stride_cs)[:, None, None] + h * stride_ch + d * stride_cd
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask)


# Under TRITON_INTERPRET=1 (read when a kernel is decorated) the kernel runs on CPU tensors in the interpreter.
INTERPRETED: bool = not isinstance(_store_kv_cache_kernel, JITFunction)


def store_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new K/V into their slots. key, value: [num_tokens, num_kv_heads, head_dim] (any strides,
    e.g. views of a fused qkv tensor); slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    # About 4k elements per program on a GPU; the interpreter pays per program, so it takes every token at once.
    block_t = triton.next_power_of_2(num_tokens) if INTERPRETED else max(1, 4096 // (block_h * block_d))
    _store_kv_cache_kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        num_tokens,
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
