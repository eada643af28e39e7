"""The decoder's elementwise steps on the CPU, each one C call (`csrc/fused_elementwise.c`): residual add +
RMSNorm, SiLU(gate) * up, per-head q/k RMSNorm + rotary embedding, and the K/V store into the paged cache.
Same signatures and results as their twins in `kernels/reference.py` (bf16 rounded where torch's ops round;
sums of squares in our own order); inputs a kernel does not take (other dtypes or devices, FP8 caches) and
machines without a C compiler go to the twin."""

from __future__ import annotations

import ctypes

import torch

from mmserve.kernels import reference
from mmserve.kernels.cbuild import CKernel

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SOURCE = "fused_elementwise.c"
# (x, x row stride, x col stride, residual, residual_out, weight, out, rows, hidden, eps, dtype, num_threads)
_ADD_RMS_NORM = CKernel(_SOURCE, "add_rms_norm", [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _i64, _i64])
# (gate_up, row stride, col stride, out, rows, inter, dtype, num_threads)
_SILU_AND_MUL = CKernel(_SOURCE, "silu_and_mul", [_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64])
# (qkv, row stride, col stride, cos, sin, q_norm, k_norm, eps, q_out, k_out, tokens, heads, kv heads, head_dim,
#  dtype, num_threads)
_ROTARY_QK = CKernel(_SOURCE, "rotary_qk", [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _f32, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64])  # fmt: skip
# (key, its token / head / dim strides, value, likewise, kv_cache, slots, tokens, num_slots, kv heads, head_dim,
#  element size)
_STORE_KV = CKernel(_SOURCE, "store_kv", [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64])  # fmt: skip
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_MAX_HIDDEN, _MAX_HEAD_DIM = 32768, 1024  # as in the C source


def load() -> bool:
    """Whether the C kernels are built (building them on first use; one warning where that is impossible)."""
    return all(k.load() is not None for k in (_ADD_RMS_NORM, _SILU_AND_MUL, _ROTARY_QK, _STORE_KV))


def functions() -> dict[str, ctypes._CFuncPtr] | None:
    """The loaded kernels by their C names (what `cpu_decoder` calls from C); None where they cannot be built."""
    kernels = {k.symbol: k.load() for k in (_ADD_RMS_NORM, _SILU_AND_MUL, _ROTARY_QK, _STORE_KV)}
    return kernels if all(f is not None for f in kernels.values()) else None  # type: ignore[return-value]


def _code(*tensors: torch.Tensor | None) -> int | None:
    """The kernels' dtype code when every given tensor is on the CPU in one dtype they compute, else None."""
    dtype = tensors[0].dtype  # type: ignore[union-attr]
    code = _DTYPES.get(dtype)
    for t in tensors:
        if t is not None and (t.dtype != dtype or not t.is_cpu):
            return None
    return code


def _check(code: int, name: str) -> None:
    if code:
        raise RuntimeError(f"{name} failed with code {code}")


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.add_rms_norm's contract."""
    kernel, code = _ADD_RMS_NORM.load(), _code(x, residual, weight)
    shape = x.shape
    if (
        kernel is None
        or code is None
        or len(shape) != 2
        or shape[1] > _MAX_HIDDEN
        or not weight.is_contiguous()
        or (residual is not None and (residual.shape != shape or not residual.is_contiguous()))
    ):
        return reference.add_rms_norm(x, residual, weight, eps)
    out = torch.empty(shape, dtype=x.dtype)
    summed = None if residual is None else torch.empty(shape, dtype=x.dtype)
    args = (x.data_ptr(), *x.stride(), _address(residual), _address(summed), weight.data_ptr(), out.data_ptr(),
            *shape, eps, code, torch.get_num_threads())  # fmt: skip
    _check(kernel(*args), "add_rms_norm")
    return out, x if summed is None else summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """reference.silu_and_mul's contract; the result row-major."""
    kernel, code = _SILU_AND_MUL.load(), _code(gate_up)
    if kernel is None or code is None or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        return reference.silu_and_mul(gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    args = (gate_up.data_ptr(), *gate_up.stride(), out.data_ptr(), rows, inter, code, torch.get_num_threads())
    _check(kernel(*args), "silu_and_mul")
    return out


def rotary_qk(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rotary_qk's contract; q and k contiguous."""
    kernel, code = _ROTARY_QK.load(), _code(qkv, cos, sin, q_norm_weight, k_norm_weight)
    tokens, head_dim = qkv.shape[0], cos.shape[-1]
    usable = (
        kernel is not None
        and code is not None
        and qkv.dim() == 2
        and head_dim <= _MAX_HEAD_DIM
        and head_dim % 2 == 0
        and qkv.shape[1] >= (num_heads + num_kv_heads) * head_dim
        and (q_norm_weight is None) == (k_norm_weight is None)
        and all(t is None or t.is_contiguous() for t in (cos, sin, q_norm_weight, k_norm_weight))
        and cos.numel() == sin.numel() == tokens * head_dim
    )
    if not usable:
        return reference.rotary_qk(qkv, cos, sin, num_heads, num_kv_heads, q_norm_weight, k_norm_weight, eps)
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype)
    k = torch.empty(tokens, num_kv_heads, head_dim, dtype=qkv.dtype)
    args = (qkv.data_ptr(), *qkv.stride(), cos.data_ptr(), sin.data_ptr(), _address(q_norm_weight),
            _address(k_norm_weight), eps, q.data_ptr(), k.data_ptr(), tokens, num_heads, num_kv_heads, head_dim,
            code, torch.get_num_threads())  # fmt: skip
    _check(kernel(*args), "rotary_qk")
    return q, k


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """reference.store_kv_cache's contract; an out-of-range slot raises IndexError and writes nothing."""
    kernel = _STORE_KV.load()
    usable = (
        kernel is not None
        and _code(key, value, kv_cache) is not None
        and key.dim() == value.dim() == 3
        and key.shape == value.shape
        and kv_cache.is_contiguous()
        and kv_cache.shape[3:] == key.shape[1:]
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.is_cpu
        and slot_mapping.shape[0] == key.shape[0]
    )
    if not usable:
        reference.store_kv_cache(key, value, kv_cache, slot_mapping, kv_scales)
        return
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    args = (key.data_ptr(), *key.stride(), value.data_ptr(), *value.stride(), kv_cache.data_ptr(),
            slot_mapping.data_ptr(), key.shape[0], num_slots, key.shape[1], key.shape[2], key.element_size())  # fmt: skip
    if kernel(*args) != 0:
        raise IndexError(f"store_kv_cache: a slot outside the cache's {num_slots} slots")


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
