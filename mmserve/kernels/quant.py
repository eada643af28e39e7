"""W4A16 linear layers in pure torch: the packed int4 weight layout (`pack_w4`), its dequantization and the
linear layer over it (`w4a16_linear`), the specification `triton_w4a16.w4a16_linear` matches and the CPU path.
Knows the tensor layout, not checkpoint formats (the loaders convert to it) or the model.

The layout, for a weight of N output rows and K input columns quantized in groups of `group_size` columns:
  qweight [N, K // 8] int32: nibble j (bits 4j..4j+3) of word i holds column 8i + j of the row, unsigned 0..15
  scales  [N, K // group_size] float (fp32, or the activations' dtype)
  zeros   [N, K // group_size] integer unsigned zero points 0..15 (uint8 or int32), or None for 8 (symmetric)
  weight[n, k] = (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

PACK = 8  # 4-bit values per int32 word
SYMMETRIC_ZERO = 8  # the zero point that `zeros=None` stands for
ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SHIFTS = tuple(range(0, 32, 4))  # nibble j of a word sits at bit 4j
# On the CPU, the fast path's dequantized rows per chunk are about this many elements (2 MB in fp32): small
# enough that unpacking, scaling and the GEMM over one chunk run out of a core's L2 rather than memory.
# Elsewhere (CUDA, where this file is only the forced reference) the whole weight is one chunk.
_CHUNK_ELEMENTS = 1 << 19
# 16-bit activations -> the rows from which weights are dequantized to x's dtype and the GEMM runs in it;
# with fewer rows (or a dtype not listed) the weights stay fp32, x is cast up and the output rounded once.
# Measured on a 2-core Xeon with AMX: bf16 GEMMs win from about 32 rows; below, the CPU's fp32 elementwise
# ops and small GEMMs beat its bf16 ones. fp16 weights were slower at every M tried (1 to 512).
_16BIT_GEMM_FROM_ROWS = {torch.bfloat16: 32}


def check_w4a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> tuple[int, int, int]:
    """(N, K, num_groups) of a W4A16 linear call; a ValueError naming the first argument that does not fit
    the layout (shapes and dtypes only: the values of codes and zero points are not read)."""
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be [M, K] fp32/fp16/bf16, got {list(x.shape)} {x.dtype}")
    k = x.shape[1]
    n, num_groups = check_w4_weight(qweight, scales, zeros, group_size, k)
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float [N] = [{n}], got {list(bias.shape)} {bias.dtype}")
    tensors = (x, qweight, scales, zeros, bias)
    if any(t is not None and t.device != x.device for t in tensors):
        raise ValueError(f"x, qweight, scales, zeros and bias must be on one device ({x.device})")
    return n, k, num_groups


def check_w4_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    k: int | None = None,
) -> tuple[int, int]:
    """(N, num_groups) of a packed weight; K is qweight's columns * 8 unless given. ValueError if the tensors
    do not fit the layout."""
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 [N, K // 8], got {list(qweight.shape)} {qweight.dtype}")
    n = qweight.shape[0]
    k = qweight.shape[1] * PACK if k is None else k
    if k % PACK:
        raise ValueError(f"K = {k} must be divisible by {PACK} (8 int4 values per int32 word)")
    if qweight.shape[1] != k // PACK:
        raise ValueError(f"qweight must be [N, K // 8] = [{n}, {k // PACK}], got {list(qweight.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or k % group_size:
        raise ValueError(f"group_size must be a positive int dividing K = {k}, got {group_size!r}")
    num_groups = k // group_size
    if tuple(scales.shape) != (n, num_groups) or not scales.is_floating_point():
        raise ValueError(
            f"scales must be float [N, K // group_size] = [{n}, {num_groups}], got {list(scales.shape)} "
            f"{scales.dtype}"
        )
    if zeros is not None and (
        tuple(zeros.shape) != (n, num_groups) or zeros.is_floating_point() or zeros.dtype == torch.bool
    ):
        raise ValueError(
            f"zeros must be integer (uint8 / int32) [N, K // group_size] = [{n}, {num_groups}] or None, "
            f"got {list(zeros.shape)} {zeros.dtype}"
        )
    return n, num_groups


def pack_w4(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] integers 0..15 (any integer dtype), K divisible by 8 -> qweight [N, K // 8] int32 with
    column 8i + j in nibble j of word i. The inverse of `unpack_w4`; values outside 0..15 are a ValueError."""
    if q.dim() != 2 or q.is_floating_point() or q.dtype == torch.bool:
        raise ValueError(f"q must be an integer [N, K] tensor, got {list(q.shape)} {q.dtype}")
    n, k = q.shape
    if k % PACK:
        raise ValueError(f"K = {k} must be divisible by {PACK}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("q must hold unsigned 4-bit values 0..15")
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=q.device)
    # In int64 so that nibble 7 (bits 28..31) does not overflow; the low 32 bits are the word's bits.
    words = (q.to(torch.int64).view(n, k // PACK, PACK) << shifts).sum(dim=-1)  # [N, K // 8]
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement: bit 31 is the sign


def unpack_w4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [N, K // 8] int32 -> q [N, K] uint8 values 0..15, in column order."""
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 [N, K // 8], got {list(qweight.shape)} {qweight.dtype}")
    n, words = qweight.shape
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=qweight.device)
    # An arithmetic shift sign-extends nibble 7's word; the mask keeps 4 bits.
    return ((qweight.unsqueeze(-1) >> shifts) & 15).to(torch.uint8).view(n, words * PACK)


def dequantize_w4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weight [N, K] in `dtype`: (q - zero) * scale per element, computed in fp32 (exact for bf16 / fp16
    scales) and rounded once to `dtype`. The definition every W4A16 path matches."""
    n, num_groups = check_w4_weight(qweight, scales, zeros, group_size)
    q = unpack_w4(qweight).view(n, num_groups, group_size).to(torch.int32)  # [N, G, group_size]
    zero = SYMMETRIC_ZERO if zeros is None else zeros.to(torch.int32).unsqueeze(-1)  # [N, G, 1]
    weight = (q - zero).to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)  # [N, G, group_size]
    return weight.view(n, num_groups * group_size).to(dtype)


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (fp32 / fp16 / bf16) @ dequantize_w4(...)^T + bias -> [M, N] in x's dtype.

    qweight / scales / zeros as in the module docstring; bias [N] or None. Weights are (q - zero) * scale in
    fp32, rounded to the GEMM's dtype: bf16 for bf16 activations from 32 rows on, else fp32 (x cast up, the
    output rounded once). Any strides. ValueError on shapes that do not fit the layout.
    """
    n, k, num_groups = check_w4a16(x, qweight, scales, zeros, group_size, bias)
    m = x.shape[0]
    compute = x.dtype if m >= _16BIT_GEMM_FROM_ROWS.get(x.dtype, 1 << 62) else torch.float32
    if m == 0 or n == 0:
        return x.new_zeros(m, n)
    if group_size % PACK or sys.byteorder != "little":
        # Groups that split a word, or words whose bytes are not in nibble order: dequantize it all.
        weight = dequantize_w4(qweight, scales, zeros, group_size, compute)
        out = F.linear(x.to(compute), weight, None if bias is None else bias.to(compute))
        return out.to(x.dtype)
    return _grouped_linear(x, qweight, scales, zeros, group_size, bias, compute, n, k, num_groups)


def _grouped_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    compute: torch.dtype,
    n: int,
    k: int,
    num_groups: int,
) -> torch.Tensor:
    """`w4a16_linear` for whole-word groups on a little-endian machine, in chunks of output rows.

    Unpacking without a shift per nibble: `word & 0x0F0F0F0F` leaves the even nibbles one per byte and
    `(word >> 4) & 0x0F0F0F0F` the odd ones, so a row's int32 words become bytes laid out as (half h, group g,
    word i, byte b) <- column g * group_size + 8i + 2b + h, converted to floats in one pass. The GEMM does not
    care in which order the columns come, so x's columns are permuted the same way instead of the weight's.
    Each weight is still exactly (q - zero) * scale rounded once to `compute`.
    """
    m = x.shape[0]
    words = group_size // PACK
    # [M, G, words, byte b, half h] -> [M, h, G, words, b]: the order the unpacked bytes come in
    xp = x.reshape(m, num_groups, words, 4, 2).permute(0, 4, 1, 2, 3).reshape(m, k).to(compute)
    # (q - zero) * scale rounds once in `compute` when the scales are in it (q - zero is exact); else in fp32.
    step = compute if scales.dtype == compute else torch.float32
    zero = SYMMETRIC_ZERO if zeros is None else zeros.to(step)[:, None, :, None]  # [N, 1, G, 1], exact
    scale = scales.to(step)[:, None, :, None]  # [N, 1, G, 1]
    bias_c = None if bias is None else bias.to(compute)
    rows = max(1, min(n, _CHUNK_ELEMENTS // k)) if x.device.type == "cpu" else n
    # Buffers reused by every chunk (a fresh allocation per chunk costs page faults at this size).
    nibbles = torch.empty(rows, 2, k // PACK, dtype=torch.int32, device=x.device)
    weight = torch.empty(rows, 2, num_groups, group_size // 2, dtype=step, device=x.device)
    out = torch.empty(m, n, dtype=compute, device=x.device)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        c = end - start
        nib, w, qw = nibbles[:c], weight[:c], qweight[start:end]  # qw: [c, K // 8]
        torch.bitwise_and(qw, 0x0F0F0F0F, out=nib[:, 0])
        torch.bitwise_right_shift(qw, 4, out=nib[:, 1])
        nib[:, 1].bitwise_and_(0x0F0F0F0F)
        w.view(c, k).copy_(nib.view(torch.uint8).view(c, k))  # q as floats, exact
        w.sub_(zero if zeros is None else zero[start:end]).mul_(scale[start:end])
        wk = w.view(c, k) if step == compute else w.view(c, k).to(compute)
        out[:, start:end] = F.linear(xp, wk, None if bias_c is None else bias_c[start:end])
    return out.to(x.dtype)
