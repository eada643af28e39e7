"""Checkpoint tensors of a quantized linear layer -> the one in-memory form every compute path uses, for each
on-disk layout (`scheme.Layout`), reading only the slice a tensor-parallel rank holds.

The canonical form (`QuantizedWeight`) of an [N, K] weight (N output rows, K input columns, this rank's):
- fp8 / int8: `codes` [N, K] (fp8 e4m3 kept as its uint8 bit pattern; int8 as is);
- int4: `codes` int32 [N, K / 8], nibble j (bits 4j..4j+3) of word i holding column 8i + j as an unsigned 0..15
  (mmserve.kernels.quant's layout);
- `scales` fp32 [N, K / group_size]: one scale per row and run of `group_size` columns (per-tensor and per-channel
  scales are one group of K columns; a block's scale is repeated over its rows, so any row split stays exact and
  fused q/k/v or gate/up parts keep their own scales);
- `zeros` uint8 [N, K / group_size], the unsigned zero point, or None (symmetric: 8 for int4, 0 for the others).
The value of a weight is (code - zero) * scale.

Knows nothing of modules or of the compute paths."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmserve.models.quant.scheme import Codes, Granularity, Layout, LinearScheme

# Reads part of a checkpoint tensor: (dim, start, length) -> that slice; only its bytes are read. dim WHOLE reads
# the whole tensor (0-d ones included).
SliceReader = Callable[[int, int, int], torch.Tensor]
WHOLE = -1

# AWQ packs output column 8w + AWQ_ORDER[j] into nibble j of word w; column 8w + c sits in nibble _AWQ_NIBBLE[c].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_NIBBLE = tuple(AWQ_ORDER.index(c) for c in range(8))
PACK = 8  # int4 values per int32 word


@dataclass(frozen=True)
class Span:
    """A run of one axis of a checkpoint weight that this rank holds: `length` of `size`, from `start`."""

    size: int
    start: int
    length: int

    @property
    def whole(self) -> bool:
        return self.length == self.size


@dataclass
class QuantizedWeight:
    """One rank's [N, K] weight in canonical form (module docstring)."""

    codes: torch.Tensor
    scales: torch.Tensor  # fp32 [N, G]
    zeros: torch.Tensor | None  # uint8 [N, G]
    group_size: int  # columns per scale; G * group_size == K

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`: (code - zero) * scale, computed in fp32 and rounded once."""
        if self.codes.dtype == torch.int32:
            from mmserve.kernels.quant import dequantize_w4

            return dequantize_w4(self.codes, self.scales, self.zeros, self.group_size, dtype)
        values = codes_to_float(self.codes)  # [N, K] fp32, exact
        n, k = values.shape
        grouped = values.view(n, k // self.group_size, self.group_size)
        if self.zeros is not None:
            grouped = grouped - self.zeros.float().unsqueeze(-1)
        return (grouped * self.scales.unsqueeze(-1)).view(n, k).to(dtype)


def codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """fp8 codes (uint8 bit patterns) or int8 codes -> their fp32 values (exactly)."""
    if codes.dtype == torch.uint8:
        return codes.view(torch.float8_e4m3fn).float()
    return codes.float()


# Checkpoint tensor names of each layout: (codes, other required, optional).
_CODES = {Layout.UNPACKED: "weight", Layout.PACKED: "weight_packed", Layout.AWQ: "qweight", Layout.FP8_BLOCK: "weight"}
_REQUIRED = {
    Layout.UNPACKED: ("weight_scale",),
    Layout.PACKED: ("weight_scale", "weight_shape"),
    Layout.AWQ: ("qzeros", "scales"),
    Layout.FP8_BLOCK: ("weight_scale_inv",),
}


def tensor_names(scheme: LinearScheme) -> tuple[str, ...]:
    """Every checkpoint tensor (besides `bias`) one quantized layer (or one fused part of it) must have."""
    names = (_CODES[scheme.layout], *_REQUIRED[scheme.layout])
    if scheme.layout is Layout.PACKED and not scheme.weights.symmetric:
        names += ("weight_zero_point",)
    return names


def read_local(scheme: LinearScheme, name: str, shape: tuple[int, ...], read: SliceReader, rows: Span,
               cols: Span) -> torch.Tensor:  # fmt: skip
    """This rank's piece of checkpoint tensor `name` of a layer whose [N, K] weight it holds `rows` x `cols` of
    (one of the two is whole): the codes' slice, or the whole of a (small) scale / zero-point tensor."""
    if name not in tensor_names(scheme):
        raise ValueError(f"{name}: not a tensor of a {scheme.describe()} layer")
    if name != _CODES[scheme.layout]:
        return read(WHOLE, 0, 0)
    n, k = rows.size, cols.size
    if scheme.layout is Layout.AWQ:  # [K, N / 8]: output columns packed
        _check_shape(name, shape, (k, _packed(n, name, "output features")))
        if not rows.whole:
            _check_packed_span(rows, "output rows")
            return read(1, rows.start // PACK, rows.length // PACK)
        return read(0, cols.start, cols.length)
    if scheme.layout is Layout.PACKED:  # [N, K / 8]
        _check_shape(name, shape, (n, _packed(k, name, "input features")))
        if not cols.whole:
            _check_packed_span(cols, "input columns")
            return read(1, cols.start // PACK, cols.length // PACK)
        return read(0, rows.start, rows.length)
    _check_shape(name, shape, (n, k))  # [N, K] codes
    return read(0, rows.start, rows.length) if cols.whole else read(1, cols.start, cols.length)


def to_canonical(scheme: LinearScheme, staged: dict[str, torch.Tensor], rows: Span, cols: Span) -> QuantizedWeight:
    """The rank's canonical weight from the pieces `read_local` returned (keyed by tensor name)."""
    group = _group_size(scheme, cols)
    _check_group_span(cols, group, scheme)
    groups = _groups_held(scheme, cols)
    if scheme.layout is Layout.AWQ:
        return _awq(staged, scheme, rows, cols, group, groups)
    row_slice = slice(rows.start, rows.start + rows.length)
    if scheme.layout is Layout.PACKED:
        expected = [rows.size, cols.size]
        if staged["weight_shape"].flatten().tolist() != expected:
            raise ValueError(f"weight_shape {staged['weight_shape'].tolist()} != layer shape {expected}")
        scales = _row_scales(staged["weight_scale"], scheme, rows, cols)[:, groups]
        zeros = None
        if not scheme.weights.symmetric:
            all_zeros = _unpack_ct_zero_points(staged["weight_zero_point"], rows.size, _num_groups(scheme, cols))
            zeros = all_zeros[row_slice, groups].contiguous()
        return QuantizedWeight(staged["weight_packed"].contiguous(), scales.contiguous(), zeros, group)
    scale_name = "weight_scale_inv" if scheme.layout is Layout.FP8_BLOCK else "weight_scale"
    codes = staged["weight"]
    expected_dtype = torch.float8_e4m3fn if scheme.weights.codes is Codes.FP8 else torch.int8
    if codes.dtype != expected_dtype:
        raise ValueError(f"weight is {codes.dtype}, but the scheme stores {scheme.weights.codes.value} codes")
    if codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)  # bit patterns: kept out of every floating-point cast
    scales = _row_scales(staged[scale_name], scheme, rows, cols)[:, groups]
    return QuantizedWeight(codes.contiguous(), scales.contiguous(), None, group)


def _num_groups(scheme: LinearScheme, cols: Span) -> int:
    """Scale columns of the whole checkpoint weight: ceil(K / group) for groups and blocks, else 1."""
    size = scheme.weights.group_size
    return -(-cols.size // size) if size is not None and scheme.weights.granularity in _GROUPED else 1


def _groups_held(scheme: LinearScheme, cols: Span) -> slice:
    """The scale columns of the rank's input columns (checked to be whole groups)."""
    size = scheme.weights.group_size
    if size is None or scheme.weights.granularity not in _GROUPED:
        return slice(0, 1)
    return slice(cols.start // size, (cols.start + cols.length) // size)


_GROUPED = (Granularity.GROUP, Granularity.BLOCK)


def _group_size(scheme: LinearScheme, cols: Span) -> int:
    """Columns per scale of the rank's weight: the scheme's group / block width, or all of its columns."""
    w = scheme.weights
    if w.granularity in (Granularity.GROUP, Granularity.BLOCK):
        assert w.group_size is not None
        return w.group_size
    return cols.length  # one scale for all of a row's columns held here (TENSOR, CHANNEL)


def _row_scales(scale: torch.Tensor, scheme: LinearScheme, rows: Span, cols: Span) -> torch.Tensor:
    """A checkpoint scale tensor -> fp32 [rows held, groups of all K columns]: one scale per row and group."""
    w = scheme.weights
    n, k = rows.size, cols.size
    scale = scale.float()
    if scheme.layout is Layout.AWQ:
        raise AssertionError("AWQ scales are converted in _awq")
    if w.granularity is Granularity.TENSOR:
        if scale.numel() != 1:
            raise ValueError(f"a per-tensor scale has {scale.numel()} elements (shape {tuple(scale.shape)})")
        full = scale.reshape(1, 1).expand(n, 1)
    elif w.granularity is Granularity.CHANNEL:
        if scale.numel() != n:
            raise ValueError(f"per-channel scales have shape {tuple(scale.shape)}, expected ({n}, 1)")
        full = scale.reshape(n, 1)
    elif w.granularity is Granularity.GROUP:
        assert w.group_size is not None
        _check_shape("scale", tuple(scale.shape), (n, -(-k // w.group_size)))
        full = scale
    else:  # BLOCK: [ceil(N / bh), ceil(K / bw)], each block row repeated over its rows (the last one cut)
        assert w.block_rows is not None and w.group_size is not None
        _check_shape("scale", tuple(scale.shape), (-(-n // w.block_rows), -(-k // w.group_size)))
        full = scale.repeat_interleave(w.block_rows, dim=0)[:n]
    return full[rows.start : rows.start + rows.length].contiguous()


def _unpack_ct_zero_points(packed: torch.Tensor, n: int, num_groups: int) -> torch.Tensor:
    """compressed-tensors' zero points, int32 [ceil(N / 8), G] packed along the rows with an offset of 8 (the
    signed zero point z is stored as z + 8) -> uint8 [N, G], the unsigned zero point."""
    _check_shape("weight_zero_point", tuple(packed.shape), (-(-n // PACK), num_groups))
    # Word w of column g holds rows 8w..8w+7 in nibbles 0..7, as `pack_to_int32(..., packed_dim=0)` writes them.
    nibbles = _unpack_nibbles(packed.t().contiguous())  # [G, 8 * words], nibble j of word w at column 8w + j
    return nibbles[:, :n].t().contiguous()


def _awq(staged: dict[str, torch.Tensor], scheme: LinearScheme, rows: Span, cols: Span, group: int,
         groups: slice) -> QuantizedWeight:  # fmt: skip
    """AutoAWQ GEMM tensors -> canonical: codes transposed to [N, K] and repacked along K; zeros and scales
    transposed to [N, G]."""
    n = rows.size
    values = _awq_unpack(staged["qweight"])  # [K held, N held] unsigned 0..15, natural column order
    codes = pack_int4(values.t().contiguous())  # [N held, K held / 8]
    qzeros, scales = staged["qzeros"], staged["scales"]
    num_groups = _num_groups(scheme, cols)
    _check_shape("qzeros", tuple(qzeros.shape), (num_groups, _packed(n, "qzeros", "output features")))
    _check_shape("scales", tuple(scales.shape), (num_groups, n))
    row_slice = slice(rows.start, rows.start + rows.length)
    zeros = _awq_unpack(qzeros)[groups, row_slice].t().contiguous()  # [N held, G held] uint8
    scale = scales.float()[groups, row_slice].t().contiguous()  # [N held, G held] fp32
    return QuantizedWeight(codes, scale, zeros, group)


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's nibble order -> uint8 [R, C], column 8w + c from nibble _AWQ_NIBBLE[c] of word w."""
    nibbles = _unpack_nibbles(packed)  # [R, C]: column 8w + j holds nibble j
    r, c = nibbles.shape
    order = torch.tensor(_AWQ_NIBBLE)
    return nibbles.view(r, c // PACK, PACK)[:, :, order].reshape(r, c)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, W] -> uint8 [R, 8W]: column 8w + j is nibble j (bits 4j..4j+3) of word w."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).reshape(packed.shape[0], -1)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] of 0..15, C a multiple of 8 -> int32 [R, C / 8], column 8w + j in nibble j of word w."""
    r, c = values.shape
    if c % PACK:
        raise ValueError(f"{c} columns do not pack into int32 words of {PACK} nibbles")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    words = (values.view(r, c // PACK, PACK).to(torch.int32) << shifts).sum(-1, dtype=torch.int64)
    return words.to(torch.int32)  # wraps into the sign bit for nibble 7 >= 8, as intended


def _packed(size: int, name: str, what: str) -> int:
    if size % PACK:
        raise ValueError(f"{name}: {size} {what} do not pack {PACK} to an int32 word")
    return size // PACK


def _check_packed_span(span: Span, what: str) -> None:
    if span.start % PACK or span.length % PACK:
        raise ValueError(
            f"tensor-parallel split of {span.size} {what} at {span.start}..{span.start + span.length} does not "
            f"fall on a {PACK}-value int32 word boundary"
        )


def _check_group_span(cols: Span, group: int, scheme: LinearScheme) -> None:
    """The rank's columns must be whole groups (blocks) of the scales they use."""
    if cols.start % group or cols.length % group:
        what = "block" if scheme.weights.granularity is Granularity.BLOCK else "group"
        where = "" if cols.whole else f" (tensor-parallel rank holding columns {cols.start}..{cols.start + cols.length})"
        raise ValueError(
            f"{cols.length} input columns{where} do not fall on the {group}-column quantization {what} boundary"
        )


def _check_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name}: checkpoint shape {tuple(shape)} != expected {tuple(expected)}")
