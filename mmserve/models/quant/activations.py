"""Dynamic symmetric quantization of a linear layer's input, per token (or per token and run of columns), as
compressed-tensors defines it: scale = max |x| / (q_max - q_min) * 2, codes = clamp(x / scale) rounded to the format
(round half to even for int8, the nearest fp8 e4m3 value for fp8). `fake_quantize` returns the values the codes
stand for; `quantize_int8` and `quantize_fp8` the codes and scales themselves (for an int8 x int8 or fp8 x fp8
matmul). Computed in fp32 whatever
the input's dtype. Knows nothing of weights."""

from __future__ import annotations

import torch

from mmserve.models.quant.scheme import ActivationScheme, Codes

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MIN, INT8_MAX = -128.0, 127.0
# compressed-tensors divides by half of the code range: (448 - -448) / 2 for fp8, (127 - -128) / 2 for int8.
_HALF_RANGE = {Codes.FP8: FP8_MAX, Codes.INT8: (INT8_MAX - INT8_MIN) / 2}


def _grouped(x: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """x [M, K] -> [M, K / group, group] (one group of K columns when group_size is None)."""
    m, k = x.shape
    size = k if group_size is None else group_size
    if k % size:
        raise ValueError(f"{k} input columns are not whole activation groups of {size}")
    return x.view(m, k // size, size)


def _scales(groups: torch.Tensor, codes: Codes) -> torch.Tensor:
    """[M, G, group] fp32 -> [M, G, 1] fp32 scales; an all-zero group gets the smallest normal scale (its codes
    are 0 whatever the scale)."""
    amax = groups.abs().amax(dim=-1, keepdim=True)
    return (amax / _HALF_RANGE[codes]).clamp_min_(torch.finfo(torch.float32).tiny)


def fake_quantize(x: torch.Tensor, scheme: ActivationScheme) -> torch.Tensor:
    """x [M, K] -> the values of its codes under `scheme`, [M, K] in x's dtype."""
    groups = _grouped(x.float(), scheme.group_size)
    scale = _scales(groups, scheme.codes)
    if scheme.codes is Codes.FP8:
        codes = (groups / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        codes = (groups / scale).clamp_(INT8_MIN, INT8_MAX).round_()
    return (codes * scale).view(x.shape).to(x.dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 codes [M, K], fp32 scales [M, 1]), one scale per token."""
    groups = _grouped(x.float(), None)  # [M, 1, K]
    scale = _scales(groups, Codes.INT8)
    codes = (groups / scale).clamp_(INT8_MIN, INT8_MAX).round_().to(torch.int8)
    return codes.view(x.shape), scale.view(-1, 1)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn codes [M, K], fp32 scales [M, 1]), one scale per token: the codes and scales
    whose products `fake_quantize` returns for per-token fp8."""
    groups = _grouped(x.float(), None)  # [M, 1, K]
    scale = _scales(groups, Codes.FP8)
    codes = (groups / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(x.shape), scale.view(-1, 1)
