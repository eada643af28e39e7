"""The CPU attention backend: decode rows through a C kernel (`csrc/paged_decode_attention.c`) that
reads K/V straight from the cache blocks, everything else through the torch reference. The kernel is
built once per machine (`kernels/cbuild.py`); `load()` returns None where that is not possible, and
dispatch then keeps the reference."""

from __future__ import annotations

import ctypes

import torch

from mmserve.kernels import fp8, reference
from mmserve.kernels.cbuild import CKernel

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# (query, kv_cache, kv_dtype, byte_table, kv_scales, block_tables, table stride, seq_lens, rows, out, begin, end,
#  num_blocks, block_size, num_heads, num_kv_heads, head_dim, scale, num_threads)
_ARGTYPES = [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64]  # fmt: skip
_KERNEL = CKernel("paged_decode_attention.c", "paged_decode_attention", _ARGTYPES)
# FP8 cache dtype -> [256] fp32 value of each byte, made once
_byte_tables: dict[torch.dtype, torch.Tensor] = {}
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 2}  # the kernel's kv_dtype codes (1: FP8 through a byte table)


def load() -> ctypes._CFuncPtr | None:
    """The compiled kernel, building it on first use; None (with one warning) where no C compiler works."""
    return _KERNEL.load()


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16)
        and (kv_cache.dtype in _KV_DTYPES or fp8.is_fp8(kv_cache.dtype))
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
    decodes: reference.DecodeRows | None = None,
) -> torch.Tensor:
    """reference.paged_attention's contract. Decodes run in the C kernel on torch's intra-op thread count, in
    fp32 (bf16 queries widened and their results rounded back; a bf16 cache widened, an FP8 one decoded
    through its byte table); prefill chunks and unsupported inputs (other dtypes, off the CPU) take the
    reference."""
    kernel = load()
    if decodes is None:
        decodes = reference.decode_rows(block_tables, query_start_loc, seq_lens)
    if kernel is None or not decodes.seqs or not supports(query, kv_cache):
        args = (query, kv_cache, block_tables, query_start_loc, seq_lens, scale, kv_scales, decodes)
        return reference.paged_attention(*args)
    query32 = query.float().contiguous()  # [num_tokens, num_heads, head_dim]
    out32 = torch.empty_like(query32)
    tables = decodes.block_tables  # [num_decodes, max_blocks]
    num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape[1:]
    table, scales = None, None
    if fp8.is_fp8(kv_cache.dtype):
        table = _byte_tables.setdefault(kv_cache.dtype, fp8.byte_table(kv_cache.dtype))
        scales = fp8.unit_scales(num_kv_heads) if kv_scales is None else kv_scales.float().contiguous()
    kv_dtype = 1 if table is not None else _KV_DTYPES[kv_cache.dtype]
    args = (query32.data_ptr(), kv_cache.data_ptr(), kv_dtype, _address(table), _address(scales), tables.data_ptr(),
            tables.stride(0), decodes.seq_lens.data_ptr(), decodes.rows.data_ptr(), out32.data_ptr())  # fmt: skip
    shape = (num_blocks, block_size, query.shape[1], num_kv_heads, head_dim, scale)
    code = kernel(*args, 0, len(decodes.seqs), *shape, torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"paged_decode_attention failed with code {code}")
    out = out32.to(query.dtype)
    if len(decodes.seqs) < len(seq_lens):
        args = (out, query, kv_cache, block_tables, query_start_loc, seq_lens, scale, kv_scales)
        reference.prefill_attention(*args)
    return out


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
