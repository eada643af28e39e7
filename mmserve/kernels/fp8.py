"""The FP8 KV cache's number formats: which cache dtypes exist, and the torch definition of writing a value
into one (divide by the scale, saturate, round to nearest even) and reading it back (decode, times the
scale). Every attention backend matches these; knows nothing of the cache layout or the model.

Scales are per KV head: `kv_scales` is [2, num_kv_heads] fp32 (row 0 for K, row 1 for V), so a per-tensor
scale is the case of equal entries. A cache in the compute dtype ignores them.
"""

from __future__ import annotations

import torch

# `--kv-cache-dtype` names -> the cache's element type; "auto" (None) stores the compute dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,  # vLLM's meaning of plain "fp8"
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """The name a user reads for a cache dtype: fp8_e4m3, fp8_e5m2, or the torch name (float32...)."""
    names = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [num_tokens, num_kv_heads, head_dim]; scale: [num_kv_heads] fp32 -> codes in `dtype`.

    Saturates at the format's largest finite value (e5m2 would otherwise round large values to inf, and a
    cache entry that is inf or NaN poisons every later attention over it)."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale[:, None]).clamp_(-limit, limit).to(dtype)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes: [..., num_kv_heads, head_dim] in an fp8 dtype; scale: [num_kv_heads] fp32 -> values in
    `dtype`: fp32(code) * scale, rounded once to `dtype`."""
    return (codes.float() * scale[:, None]).to(dtype)


def unit_scales(num_kv_heads: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[2, num_kv_heads] fp32 ones: the scales of a cache without calibrated ones (vLLM's default of 1.0)."""
    return torch.ones(2, num_kv_heads, dtype=torch.float32, device=device)


# Calibrated scales map this multiple of the calibration batch's largest |K| (|V|) to the format's largest
# finite value: later tokens up to that much larger still fit before saturating.
CALIBRATION_HEADROOM = 2.0


def calibrated_scales(key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """key, value: [num_tokens, num_kv_heads, head_dim] -> [2, num_kv_heads] fp32 scales from their per-head
    largest magnitude (vLLM's `calculate_kv_scales`, per head): small values then use the format's normal
    range instead of its coarse subnormals. A head that is all zeros gets scale 1."""
    amax = torch.stack([key.detach().abs().amax(dim=(0, 2)), value.detach().abs().amax(dim=(0, 2))]).float()
    scales = amax * (CALIBRATION_HEADROOM / torch.finfo(dtype).max)
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def byte_table(dtype: torch.dtype) -> torch.Tensor:
    """[256] fp32: the value of every byte as a code of `dtype` (NaN codes included; they are never
    written, since `quantize` saturates). The C kernel decodes through it."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
