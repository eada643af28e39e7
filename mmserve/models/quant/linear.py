"""`QuantizedLinear`: a quantized decoder projection holding one tensor-parallel rank's slice (a column-parallel
layer's parts, e.g. q/k/v, or a row-parallel layer's input columns), and the compute path it runs, picked once:

- "dequantized": the weight is dequantized to fp32 at load (the model's cast then rounds it to the compute dtype
  once); the forward is a plain matmul. Fast, full memory.
- "native": the weight stays in its codes (fp8 / int8 [N, K], or int4 packed 8 to an int32) with fp32 scales;
  int4 runs the W4A16 linear the runner picked (`kernels/dispatch.py`: Triton on CUDA, `kernels/quant.py`'s
  torch twin elsewhere), int8 weights with int8 activations run an int8 x int8 matmul (`torch._int_mm`, on the
  CPU), fp8 weights per tensor or channel with fp8 activations per token an fp8 x fp8 GEMM (`torch._scaled_mm`
  with row-wise scales, on CUDA devices that have fp8 tensor cores), and the rest dequantize the weight on the
  fly for each forward.

Both paths apply the checkpoint's dynamic activation quantization (the model's numerics, as compressed-tensors and
vLLM run it), so they compute the same function up to rounding order. Loading goes through `formats.py`; knows
nothing of checkpoint files or requests."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from enum import StrEnum

import torch
from torch import nn

from mmserve.distributed.group import TensorParallelGroup
from mmserve.kernels import quant as w4a16_reference
from mmserve.kernels.cpu_linear import BLAS_PATHS, LinearPaths
from mmserve.models.parallel import (
    ColumnParallelLinear,
    Linear,
    OutputPart,
    ParallelLMHead,
    RowParallelLinear,
    SliceReader,
)
from mmserve.models.quant.activations import fake_quantize, quantize_fp8, quantize_int8
from mmserve.models.quant.formats import QuantizedWeight, Span, read_local, tensor_names, to_canonical
from mmserve.models.quant.scheme import Codes, Granularity, LinearScheme

QUANT_COMPUTE_ENV = "MMSERVE_QUANT_COMPUTE"  # auto | dequantized | native
CPU = torch.device("cpu")
# x [M, K], packed int4 weight [N, K / 8], scales, zero points or None, group size, bias or None -> [M, N]
W4A16Linear = Callable[..., torch.Tensor]


class ComputePath(StrEnum):
    DEQUANTIZED = "dequantized"
    NATIVE = "native"


def default_compute_path(scheme: LinearScheme, device: torch.device) -> ComputePath:
    """The path "auto" picks for `scheme` on `device`: native (the memory quantization is for) unless its speed is
    not acceptable. `mmserve bench quantization` on the bench preset (bf16, 2 Xeon cores): int8 x int8 native runs
    decode at the dequantized speed (1.5x it at batch 1) in 0.63x the bytes; int4 native at 0.4-0.5x the
    dequantized decode speed in 0.45x the bytes (kept: an int4 checkpoint is chosen to fit memory, and GPUs run
    the Triton twin); fp8 native without fp8 GEMMs (the CPU) dequantizes the whole weight per forward, 4.5x
    (batch) to 8.5x (batch 1) slower decode, so fp8 dequantizes at load there and runs fp8 GEMMs where the
    device has them (per-tensor or per-channel weights, per-token activations)."""
    w, a = scheme.weights, scheme.activations
    if w.codes is Codes.INT4:
        return ComputePath.NATIVE
    if w.codes is Codes.INT8 and a is not None and a.codes is Codes.INT8 and _per_row(scheme):
        return ComputePath.NATIVE
    if _fp8_gemm_scheme(scheme) and fp8_gemm_available(device):
        return ComputePath.NATIVE
    return ComputePath.DEQUANTIZED


def resolve_compute_path(scheme: LinearScheme, requested: str | None = None,
                         device: torch.device = CPU) -> ComputePath:  # fmt: skip
    """`requested` ("auto" | "dequantized" | "native"), else $MMSERVE_QUANT_COMPUTE, else "auto" (for `device`)."""
    value = (requested or os.environ.get(QUANT_COMPUTE_ENV) or "auto").strip().lower()
    if value == "auto":
        return default_compute_path(scheme, device)
    try:
        return ComputePath(value)
    except ValueError:
        raise ValueError(
            f"quantized compute path must be auto, dequantized or native, got {value!r} (${QUANT_COMPUTE_ENV})"
        ) from None


@functools.cache
def fp8_gemm_available(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs fp8 x fp8 GEMMs on `device` at tensor-core speed: CUDA devices of compute
    capability 8.9 (Ada, Hopper) and later. The CPU has a `_scaled_mm` too, but far slower than a dequantized
    weight's GEMM, so the native fp8 path dequantizes there."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


_CODE_BYTES = {Codes.FP8: 1.0, Codes.INT8: 1.0, Codes.INT4: 0.5}


def held_bytes_per_weight(scheme: LinearScheme, path: ComputePath, dtype: torch.dtype, in_features: int) -> float:
    """Bytes one weight of an [N, `in_features`] projection takes when loaded on `path`: the compute dtype's when
    dequantized; natively, its code plus its share of the fp32 scales (and uint8 zero points) of its row's groups
    (a block's scale is held once per row)."""
    if path is ComputePath.DEQUANTIZED:
        return float(dtype.itemsize)
    w = scheme.weights
    columns_per_scale = in_features if w.group_size is None else w.group_size
    return _CODE_BYTES[w.codes] + (4 + (0 if w.symmetric else 1)) / columns_per_scale


def _per_row(scheme: LinearScheme) -> bool:
    """One weight scale per output row (per-tensor or per-channel): the scale factors out of the row's dot product."""
    return scheme.weights.granularity in (Granularity.TENSOR, Granularity.CHANNEL)


def _fp8_gemm_scheme(scheme: LinearScheme) -> bool:
    """fp8 weights with a scale per row and fp8 activations per token: a row-wise scaled fp8 x fp8 GEMM."""
    a = scheme.activations
    return (
        scheme.weights.codes is Codes.FP8 and _per_row(scheme)
        and a is not None and a.codes is Codes.FP8 and a.group_size is None
    )  # fmt: skip


class QuantizedLinear(nn.Module):
    """This rank's output rows `parts` (in order; one part unless fused) and input columns `in_part` of a quantized
    [N, K] projection. `tp` set: a row-parallel layer, whose partial outputs are all-reduced and bias added once.
    Dense products (a dequantized weight) take `linear_paths`, as `Linear`'s do."""

    linear_paths: LinearPaths = BLAS_PATHS  # the model's measured CPU paths once the runner sets them

    def __init__(self, scheme: LinearScheme, parts: list[OutputPart], in_part: OutputPart, bias: bool,
                 tp: TensorParallelGroup | None, compute: ComputePath,
                 w4a16_linear: W4A16Linear = w4a16_reference.w4a16_linear) -> None:  # fmt: skip
        super().__init__()
        self.scheme, self.parts, self.in_part, self.compute = scheme, parts, in_part, compute
        self.w4a16_linear = w4a16_linear
        self.out_features, self.in_features = sum(p.length for p in parts), in_part.length
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        # The int8 x int8 matmul: int8 weights and activations, a scale per row (factors out of each dot product).
        a = scheme.activations
        self.int8_matmul = (
            compute is ComputePath.NATIVE and scheme.weights.codes is Codes.INT8 and a is not None
            and a.codes is Codes.INT8 and a.group_size is None and _per_row(scheme)
        )  # fmt: skip
        # The fp8 x fp8 GEMM: fp8 weights and activations, a scale per row (used where `fp8_gemm_available`).
        self.fp8_matmul = compute is ComputePath.NATIVE and _fp8_gemm_scheme(scheme)
        self.group_size = 0  # columns per scale, set by finalize
        self.weight: nn.Parameter | None = None  # dequantized path, set by finalize
        self.codes: torch.Tensor | None  # native path buffers, set by finalize
        self.scales: torch.Tensor | None
        self.zeros: torch.Tensor | None
        for name in ("codes", "scales", "zeros"):
            self.register_buffer(name, None)
        self._staged: dict[int, dict[str, torch.Tensor]] = {}  # part -> checkpoint tensor name -> this rank's piece
        self._bias_loaded: set[int] = set()

    @classmethod
    def replacing(cls, layer: nn.Module, scheme: LinearScheme, compute: ComputePath,
                  w4a16_linear: W4A16Linear = w4a16_reference.w4a16_linear) -> QuantizedLinear:  # fmt: skip
        """The quantized twin of a decoder layer (same slice of the same projection), not yet loaded."""
        if isinstance(layer, ParallelLMHead):
            raise ValueError("a quantized lm_head is not supported (keep it unquantized: list it in `ignore`)")
        if not isinstance(layer, Linear):
            raise ValueError(f"{type(layer).__name__} cannot be quantized (only linear projections)")
        bias = layer.bias is not None
        whole_in = OutputPart(layer.in_features, 0, layer.in_features)
        if isinstance(layer, RowParallelLinear):
            out = OutputPart(layer.out_features, 0, layer.out_features)
            return cls(scheme, [out], layer.in_part, bias, layer.tp, compute, w4a16_linear)
        if isinstance(layer, ColumnParallelLinear):
            return cls(scheme, list(layer.parts), whole_in, bias, None, compute, w4a16_linear)
        whole_out = OutputPart(layer.out_features, 0, layer.out_features)
        return cls(scheme, [whole_out], whole_in, bias, None, compute, w4a16_linear)

    # -------------------------------------------------------------------------------------------- loading

    def load_weight(self, name: str, shape: tuple[int, ...], read: SliceReader, part: int | None) -> None:
        """Take this rank's piece of checkpoint tensor `name` (of fused part `part`: q/k/v, gate/up)."""
        if part is not None and not 0 <= part < len(self.parts):
            raise ValueError(f"{name}: part {part} of a layer with {len(self.parts)} parts")
        if name == "bias":
            self._load_bias(shape, read, part)
            return
        if part is None and len(self.parts) > 1:
            raise ValueError(f"{name}: quantized projections stored already fused are not supported")
        index = 0 if part is None else part
        piece = read_local(self.scheme, name, shape, read, self._rows(index), self._cols())
        self._staged.setdefault(index, {})[name] = piece

    def _load_bias(self, shape: tuple[int, ...], read: SliceReader, part: int | None) -> None:
        """This rank's rows of each part (a row-parallel layer's one part is all its rows: its bias is whole,
        added once after the all-reduce)."""
        if self.bias is None:
            raise ValueError("bias: this layer has no bias")
        indices = range(len(self.parts)) if part is None else [part]
        expected = sum(self.parts[i].size for i in indices)
        if tuple(shape) != (expected,):
            raise ValueError(f"bias: checkpoint shape {tuple(shape)} != ({expected},)")
        offset = 0
        with torch.no_grad():
            for i in indices:
                p = self.parts[i]
                local = sum(q.length for q in self.parts[:i])
                self.bias.narrow(0, local, p.length).copy_(read(0, offset + p.start, p.length))
                offset += p.size
        self._bias_loaded.update(indices)

    def _rows(self, index: int) -> Span:
        p = self.parts[index]
        return Span(p.size, p.start, p.length)

    def _cols(self) -> Span:
        return Span(self.in_part.size, self.in_part.start, self.in_part.length)

    def missing(self) -> list[str]:
        """Checkpoint tensors not loaded yet, as `{name}#{part}`."""
        names = tensor_names(self.scheme)
        out = [f"{n}#{i}" for i in range(len(self.parts)) for n in names if n not in self._staged.get(i, {})]
        if self.bias is not None:
            out += [f"bias#{i}" for i in range(len(self.parts)) if i not in self._bias_loaded]
        return out

    def finalize(self) -> None:
        """Convert the loaded pieces into the compute path's tensors (after every tensor is loaded)."""
        pieces = [to_canonical(self.scheme, self._staged[i], self._rows(i), self._cols()) for i in range(len(self.parts))]
        weight = _concat_rows(pieces)
        self._staged.clear()
        self.group_size = weight.group_size
        if self.compute is ComputePath.DEQUANTIZED:
            self.weight = nn.Parameter(weight.dequantize(torch.float32), requires_grad=False)
            return
        self.codes, self.scales, self.zeros = weight.codes, weight.scales, weight.zeros

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> QuantizedLinear:
        """Casts and moves as nn.Module does, except that the scales stay fp32 (they only move): the model's
        `.to(dtype)` would otherwise round them to the compute dtype. Codes are integer tensors, never cast."""
        scales = self.scales
        super()._apply(fn, recurse)
        if scales is not None and scales.device.type != "meta":
            device = fn(torch.empty(0, device=scales.device)).device  # where the cast sends tensors
            self.scales = scales.to(device)
        return self

    # -------------------------------------------------------------------------------------------- forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features held] -> [num_tokens, out_features held] (all-reduced when row-parallel)."""
        local_bias = self.bias if self.tp is None else None
        if self.int8_matmul:
            out = self._int8_matmul(x, local_bias)
        elif self.fp8_matmul and self._fp8_gemm_fits(x):
            out = self._fp8_matmul(x, local_bias)
        else:
            if self.scheme.activations is not None:
                x = fake_quantize(x, self.scheme.activations)
            out = self._matmul(x, local_bias)
        if self.tp is None:
            return out
        out = self.tp.all_reduce(out.contiguous())
        return out if self.bias is None else out + self.bias

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight is not None:
            return self.linear_paths.linear(x, self.weight, bias)
        assert self.codes is not None and self.scales is not None
        if self.scheme.weights.codes is Codes.INT4:
            return self.w4a16_linear(x, self.codes, self.scales, self.zeros, self.group_size, bias)
        weight = QuantizedWeight(self.codes, self.scales, self.zeros, self.group_size).dequantize(x.dtype)
        return self.linear_paths.linear(x, weight, bias)

    def _int8_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """int8 codes of x (per token) times the int8 weight codes, exact in int32, then both scales."""
        assert self.codes is not None and self.scales is not None
        if x.device.type != "cpu":  # torch._int_mm's GPU kernels constrain shapes: dequantize there instead
            return self._matmul(fake_quantize(x, self.scheme.activations), bias)  # type: ignore[arg-type]
        codes, x_scale = quantize_int8(x)  # [M, K] int8, [M, 1] fp32
        acc = torch._int_mm(codes, self.codes.t())  # [M, N] int32
        out = acc.float() * x_scale * self.scales.view(1, -1)  # scales [N, 1]: one per row
        if bias is not None:
            out = out + bias
        return out.to(x.dtype)


    def _fp8_gemm_fits(self, x: torch.Tensor) -> bool:
        """`torch._scaled_mm`'s row-wise fp8 GEMM takes this call: a device with fp8 GEMMs and, on CUDA, K and N
        multiples of 16 (its kernels' alignment)."""
        if not fp8_gemm_available(x.device):
            return False
        return x.device.type != "cuda" or (self.in_features % 16 == 0 and self.out_features % 16 == 0)

    def _fp8_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """fp8 codes of x (per token) times the fp8 weight codes, both scales applied by the GEMM's epilogue."""
        assert self.codes is not None and self.scales is not None
        codes, x_scale = quantize_fp8(x)  # [M, K] fp8, [M, 1] fp32
        weight = self.codes.view(torch.float8_e4m3fn).t()  # [K, N], column-major as _scaled_mm wants it
        # CUDA's row-wise kernels write bf16 (the activations' fp8 codes carry less precision than that).
        out_dtype = torch.bfloat16 if x.device.type == "cuda" else torch.float32
        out = torch._scaled_mm(codes, weight, scale_a=x_scale, scale_b=self.scales.view(1, -1), out_dtype=out_dtype)
        if bias is not None:
            out = out + bias
        return out.to(x.dtype)


def _concat_rows(pieces: list[QuantizedWeight]) -> QuantizedWeight:
    """Fused parts one after another along the output rows; each keeps its own scales (and zero points)."""
    if len(pieces) == 1:
        return pieces[0]
    if len({p.group_size for p in pieces}) != 1 or len({p.zeros is None for p in pieces}) != 1:
        raise ValueError("the fused parts of a projection are quantized differently")
    zeros = None if pieces[0].zeros is None else torch.cat([p.zeros for p in pieces])  # type: ignore[misc]
    return QuantizedWeight(
        torch.cat([p.codes for p in pieces]), torch.cat([p.scales for p in pieces]), zeros, pieces[0].group_size
    )


def replace_with_quantized(model: nn.Module, schemes: dict[str, LinearScheme], compute: str | None = None,
                           w4a16_linear: W4A16Linear = w4a16_reference.w4a16_linear,
                           device: torch.device = CPU) -> None:  # fmt: skip
    """Swap each layer named in `schemes` (the model's module names, e.g. `layers.0.self_attn.qkv_proj`) for its
    `QuantizedLinear` twin, in place; call on the meta device, before the weights are allocated. `compute`:
    "auto" | "dequantized" | "native" (None: $MMSERVE_QUANT_COMPUTE, else auto), resolved per layer's scheme for
    `device`, where the model will run. `w4a16_linear`: the int4 layers' native kernel (`kernels/dispatch.py`'s
    choice for that device)."""
    for name, scheme in schemes.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = getattr(parent, leaf)
        path = resolve_compute_path(scheme, compute, device)
        setattr(parent, leaf, QuantizedLinear.replacing(layer, scheme, path, w4a16_linear))
