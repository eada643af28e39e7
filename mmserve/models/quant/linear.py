"""`QuantizedLinear`: a quantized decoder projection holding one tensor-parallel rank's slice (a column-parallel
layer's parts, e.g. q/k/v, or a row-parallel layer's input columns), and the compute path it runs, picked once:

- "dequantized": the weight is dequantized to fp32 at load (the model's cast then rounds it to the compute dtype
  once); the forward is a plain matmul. Fast, full memory.
- "native": the weight stays in its codes (fp8 / int8 [N, K], or int4 packed 8 to an int32) with fp32 scales;
  int4 runs `mmserve.kernels.quant.w4a16_linear`, int8 weights with int8 activations run an int8 x int8 matmul
  (`torch._int_mm`, on the CPU), and the rest dequantize the weight on the fly for each forward.

Both paths apply the checkpoint's dynamic activation quantization (the model's numerics, as compressed-tensors and
vLLM run it), so they compute the same function up to rounding order. Loading goes through `formats.py`; knows
nothing of checkpoint files or requests."""

from __future__ import annotations

import os
from collections.abc import Callable
from enum import StrEnum

import torch
from torch import nn

from mmserve.distributed.group import TensorParallelGroup
from mmserve.models.parallel import (
    ColumnParallelLinear,
    Linear,
    OutputPart,
    ParallelLMHead,
    RowParallelLinear,
    SliceReader,
    linear_forward,
)
from mmserve.models.quant.activations import fake_quantize, quantize_int8
from mmserve.models.quant.formats import QuantizedWeight, Span, read_local, tensor_names, to_canonical
from mmserve.models.quant.scheme import Codes, Granularity, LinearScheme

QUANT_COMPUTE_ENV = "MMSERVE_QUANT_COMPUTE"  # auto | dequantized | native


class ComputePath(StrEnum):
    DEQUANTIZED = "dequantized"
    NATIVE = "native"


def default_compute_path(scheme: LinearScheme) -> ComputePath:
    """The path "auto" picks for `scheme`: native (the memory quantization is for) unless its speed is not
    acceptable. `mmserve bench quantization` on the bench preset (bf16, 2 Xeon cores): int8 x int8 native runs
    decode at the dequantized speed (1.5x it at batch 1) in 0.63x the bytes; int4 native at 0.4-0.5x the
    dequantized decode speed in 0.45x the bytes (kept: an int4 checkpoint is chosen to fit memory, and GPUs run
    the Triton twin); fp8 native dequantizes the whole weight per forward, 4.5x (batch) to 8.5x (batch 1) slower
    decode, so fp8 dequantizes at load."""
    w, a = scheme.weights, scheme.activations
    if w.codes is Codes.INT4:
        return ComputePath.NATIVE
    if w.codes is Codes.INT8 and a is not None and a.codes is Codes.INT8 and _per_row(scheme):
        return ComputePath.NATIVE
    return ComputePath.DEQUANTIZED


def resolve_compute_path(scheme: LinearScheme, requested: str | None = None) -> ComputePath:
    """`requested` ("auto" | "dequantized" | "native"), else $MMSERVE_QUANT_COMPUTE, else "auto"."""
    value = (requested or os.environ.get(QUANT_COMPUTE_ENV) or "auto").strip().lower()
    if value == "auto":
        return default_compute_path(scheme)
    try:
        return ComputePath(value)
    except ValueError:
        raise ValueError(
            f"quantized compute path must be auto, dequantized or native, got {value!r} (${QUANT_COMPUTE_ENV})"
        ) from None


def _per_row(scheme: LinearScheme) -> bool:
    """One weight scale per output row (per-tensor or per-channel): the scale factors out of the row's dot product."""
    return scheme.weights.granularity in (Granularity.TENSOR, Granularity.CHANNEL)


class QuantizedLinear(nn.Module):
    """This rank's output rows `parts` (in order; one part unless fused) and input columns `in_part` of a quantized
    [N, K] projection. `tp` set: a row-parallel layer, whose partial outputs are all-reduced and bias added once."""

    def __init__(self, scheme: LinearScheme, parts: list[OutputPart], in_part: OutputPart, bias: bool,
                 tp: TensorParallelGroup | None, compute: ComputePath) -> None:  # fmt: skip
        super().__init__()
        self.scheme, self.parts, self.in_part, self.compute = scheme, parts, in_part, compute
        self.out_features, self.in_features = sum(p.length for p in parts), in_part.length
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        # The int8 x int8 matmul: int8 weights and activations, a scale per row (factors out of each dot product).
        a = scheme.activations
        self.int8_matmul = (
            compute is ComputePath.NATIVE and scheme.weights.codes is Codes.INT8 and a is not None
            and a.codes is Codes.INT8 and a.group_size is None and _per_row(scheme)
        )  # fmt: skip
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
    def replacing(cls, layer: nn.Module, scheme: LinearScheme, compute: ComputePath) -> QuantizedLinear:
        """The quantized twin of a decoder layer (same slice of the same projection), not yet loaded."""
        if isinstance(layer, ParallelLMHead):
            raise ValueError("a quantized lm_head is not supported (keep it unquantized: list it in `ignore`)")
        if not isinstance(layer, Linear):
            raise ValueError(f"{type(layer).__name__} cannot be quantized (only linear projections)")
        bias = layer.bias is not None
        whole_in = OutputPart(layer.in_features, 0, layer.in_features)
        if isinstance(layer, RowParallelLinear):
            out = OutputPart(layer.out_features, 0, layer.out_features)
            return cls(scheme, [out], layer.in_part, bias, layer.tp, compute)
        if isinstance(layer, ColumnParallelLinear):
            return cls(scheme, list(layer.parts), whole_in, bias, None, compute)
        return cls(scheme, [OutputPart(layer.out_features, 0, layer.out_features)], whole_in, bias, None, compute)

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
            return linear_forward(x, self.weight, bias)
        assert self.codes is not None and self.scales is not None
        if self.scheme.weights.codes is Codes.INT4:
            from mmserve.kernels.quant import w4a16_linear

            return w4a16_linear(x, self.codes, self.scales, self.zeros, self.group_size, bias)
        weight = QuantizedWeight(self.codes, self.scales, self.zeros, self.group_size).dequantize(x.dtype)
        return linear_forward(x, weight, bias)

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


def replace_with_quantized(model: nn.Module, schemes: dict[str, LinearScheme], compute: str | None = None) -> None:
    """Swap each layer named in `schemes` (the model's module names, e.g. `layers.0.self_attn.qkv_proj`) for its
    `QuantizedLinear` twin, in place; call on the meta device, before the weights are allocated. `compute`:
    "auto" | "dequantized" | "native" (None: $MMSERVE_QUANT_COMPUTE, else auto), resolved per layer's scheme."""
    for name, scheme in schemes.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = getattr(parent, leaf)
        setattr(parent, leaf, QuantizedLinear.replacing(layer, scheme, resolve_compute_path(scheme, compute)))
