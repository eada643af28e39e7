"""Triton twin of `reference.store_kv_cache`: writes each new token's K/V into its paged-cache slot, as FP8
codes for an FP8 cache (`encode_fp8`: the bit-exact twin of `fp8.quantize`, in integer arithmetic so it
compiles for every arch, sm_80 included, and runs in the interpreter). Knows the cache layout only
([2, num_blocks, block_size, num_kv_heads, head_dim]), not the model."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from mmserve.kernels import fp8

# FP8 cache dtype -> (mantissa bits, exponent bias, largest finite value) of its codes
FP8_FORMATS = {torch.float8_e4m3fn: (3, 7, 448.0), torch.float8_e5m2: (2, 15, 57344.0)}


@triton.jit
def encode_fp8(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr):
    """x: fp32 (already divided by its scale) -> uint8 codes of the format with MANT mantissa bits and
    exponent bias BIAS: saturated at +-MAX, rounded to nearest even; what torch's cast gives."""
    a = tl.minimum(tl.abs(x), MAX)
    bits = a.to(tl.int32, bitcast=True)
    SHIFT: tl.constexpr = 23 - MANT
    # Normal codes: round the fp32 mantissa to MANT bits (ties to even; a carry moves into the exponent),
    # then rebias the exponent from 127 to BIAS.
    rounded = bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)
    normal = (rounded >> SHIFT) - ((127 - BIAS) << MANT)
    # Subnormal codes (a below the smallest normal, 2^(1 - BIAS)): the count of 2^(1 - BIAS - MANT) units,
    # rounded to even. The products are exact (powers of two), so is the split into whole and fraction.
    units = a * (2.0 ** (BIAS + MANT - 1))
    whole = units.to(tl.int32)  # truncates; units >= 0
    frac = units - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    code = tl.where(a < 2.0 ** (1 - BIAS), whole + up.to(tl.int32), normal)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80  # from the bits: -0.0 keeps its sign, as torch's cast
    return (code | sign).to(tl.uint8)


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], any strides
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], any strides
    k_cache_ptr,  # kv_cache[0]: [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # kv_cache[1]: same strides as k_cache
    slot_mapping_ptr,  # [num_tokens] int64
    kv_scales_ptr,  # FP8 only: [2, num_kv_heads] fp32 (K, V)
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
    FP8_MANT: tl.constexpr,  # 0: the cache holds the compute dtype; else its FP8 codes' mantissa bits
    FP8_BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
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
    if FP8_MANT:  # the caches are uint8 views of the codes
        h_ok = h < num_kv_heads
        k_scale = tl.load(kv_scales_ptr + h, mask=h_ok, other=1.0)  # [1, BLOCK_H, 1]
        v_scale = tl.load(kv_scales_ptr + num_kv_heads + h, mask=h_ok, other=1.0)
        tl.store(k_cache_ptr + dst, encode_fp8(k.to(tl.float32) / k_scale, FP8_MANT, FP8_BIAS, FP8_MAX), mask)
        tl.store(v_cache_ptr + dst, encode_fp8(v.to(tl.float32) / v_scale, FP8_MANT, FP8_BIAS, FP8_MAX), mask)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask)


# Under TRITON_INTERPRET=1 (read when a kernel is decorated) the kernel runs on CPU tensors in the interpreter.
INTERPRETED: bool = not isinstance(_store_kv_cache_kernel, JITFunction)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write new K/V into their slots. key, value: [num_tokens, num_kv_heads, head_dim] (any strides,
    e.g. views of a fused qkv tensor); slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset;
    kv_scales: [2, num_kv_heads] fp32, used by an FP8 cache only (None: ones)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    mant, bias, limit = FP8_FORMATS.get(kv_cache.dtype, (0, 0, 0.0))
    if mant:
        kv_cache = kv_cache.view(torch.uint8)
        if kv_scales is None:
            kv_scales = fp8.unit_scales(num_kv_heads, kv_cache.device)
        kv_scales = kv_scales.to(device=kv_cache.device, dtype=torch.float32).contiguous()
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
        kv_scales if mant else slot_mapping,  # an unused pointer without FP8
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
        FP8_MANT=mant,
        FP8_BIAS=bias,
        FP8_MAX=limit,
    )
