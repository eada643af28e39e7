"""A dense decoder's forward over decode rows on the CPU in one C call (`csrc/decoder_decode.c`): the kernels the
composed path calls layer by layer (`cpu_fused`, `cpu_linear`'s C product, `cpu_attention`), called by C in the
same order with the same arguments, so the hidden states are bit-identical to the composed path's; what goes is
the ~11 Python / ctypes crossings per layer. The model decides when a step may take it (`DecodeStack.takes`)."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmserve.kernels import cpu_attention, cpu_fused, cpu_linear
from mmserve.kernels.cbuild import CKernel
from mmserve.kernels.reference import DecodeRows

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# (kernels, layers, num_layers, final_norm, x, out, cos, sin, slots, block_tables, table_stride, seq_lens, rows,
#  hidden, num_heads, num_kv_heads, head_dim, inter, num_blocks, block_size, eps, scale, dtype, num_threads)
_ARGTYPES = [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _i64, _i64]  # fmt: skip
_KERNEL = CKernel("decoder_decode.c", "decoder_decode", _ARGTYPES)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ENV = "MMSERVE_CPU_DECODE_STACK"  # 0: every step composed, layer by layer (the model runner reads it)
_MAX_HEADS = 64  # cpu_attention's kernel's
_MAX_HIDDEN, _MAX_HEAD_DIM = 32768, 1024  # cpu_fused's kernels' (past them the composed path takes the torch twins)


class _Kernels(ctypes.Structure):
    """decoder_decode.c's Kernels: the addresses of the loaded kernels the composed path calls."""

    _fields_ = [(name, _ptr) for name in ("add_rms_norm", "small_linear", "rotary_qk", "store_kv",
                                           "paged_decode_attention", "silu_and_mul")]  # fmt: skip


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's tensors, in decoder_decode.c's field order (the KV cache comes per step)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q + 2 kv, hidden]
    qkv_bias: torch.Tensor | None  # [q + 2 kv]
    q_norm: torch.Tensor | None  # [head_dim]: Qwen3's per-head norms, both or neither
    k_norm: torch.Tensor | None
    o: torch.Tensor  # [hidden, q]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 inter, hidden]
    down: torch.Tensor  # [hidden, inter]


@dataclass(frozen=True)
class DecoderShape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float  # every RMSNorm's, the q/k norms' too


def load() -> bool:
    """Whether decoder_decode and every kernel it calls are built (building them on first use)."""
    return _kernels() is not None


def _kernels() -> _Kernels | None:
    """The loaded kernels' addresses; None where one of them (or decoder_decode itself) cannot be built."""
    functions = {**(cpu_fused.functions() or {}), "small_linear": cpu_linear.load(),
                 "paged_decode_attention": cpu_attention.load()}  # fmt: skip
    if _KERNEL.load() is None or any(functions.get(name) is None for name, _ in _Kernels._fields_):
        return None
    return _Kernels(*(ctypes.cast(functions[name], _ptr).value for name, _ in _Kernels._fields_))


class DecodeStack:
    """The decoder's layers and final norm over decode rows in one call. Build with `create`, which says why not
    where the weights or this machine do not allow it."""

    def __init__(self, kernels: _Kernels, layers: Sequence[LayerWeights], final_norm: torch.Tensor,
                 shape: DecoderShape) -> None:  # fmt: skip
        self.shape, self.dtype = shape, final_norm.dtype
        self._kernels = kernels
        self._final_norm = final_norm
        self._layers = list(layers)  # keeps every address in the table alive
        # [num_layers, 10] int64: the weights' addresses, then each layer's KV cache (filled by _table)
        self._addresses = [[0 if t is None else t.data_ptr() for t in _fields(layer)] for layer in self._layers]
        self._table: torch.Tensor | None = None
        self._kv_addresses: tuple[int, ...] = ()

    @classmethod
    def create(
        cls, layers: Sequence[LayerWeights], final_norm: torch.Tensor, shape: DecoderShape
    ) -> DecodeStack | str:
        """The stack, or why it cannot run these weights here."""
        dtype = final_norm.dtype
        if dtype not in _DTYPES:
            return f"dtype {dtype} (fp32 and bf16 only)"
        tensors = [final_norm, *(t for layer in layers for t in _fields(layer) if t is not None)]
        if not all(t.is_cpu and t.dtype == dtype and t.is_contiguous() for t in tensors):
            return "weights off the CPU, in mixed dtypes or not contiguous"
        if not layers or any((layer.q_norm is None) != (layer.k_norm is None) for layer in layers):
            return "no layers, or a layer with one of the q/k norms"
        if shape.num_heads > _MAX_HEADS or shape.num_heads % shape.num_kv_heads or shape.head_dim % 2:
            return f"{shape.num_heads} query heads over {shape.num_kv_heads} KV heads of {shape.head_dim} dims"
        if shape.hidden > _MAX_HIDDEN or shape.head_dim > _MAX_HEAD_DIM:
            return f"hidden size {shape.hidden} or head_dim {shape.head_dim} past the C kernels' limits"
        expected = _shapes(shape)
        for i, layer in enumerate(layers):
            for name, tensor in zip(expected, _fields(layer), strict=True):
                if tensor is not None and tuple(tensor.shape) != expected[name]:
                    return f"layer {i}'s {name} is {tuple(tensor.shape)}, not {expected[name]}"
        if tuple(final_norm.shape) != (shape.hidden,):
            return f"the final norm is {tuple(final_norm.shape)}, not ({shape.hidden},)"
        kernels = _kernels()
        if kernels is None:
            return "the C kernels could not be built (see the log)"
        return cls(kernels, layers, final_norm, shape)

    @staticmethod
    def takes(num_tokens: int, decodes: object) -> bool:
        """Whether a step of `num_tokens` rows whose attention metadata is `decodes` is decode rows alone."""
        return isinstance(decodes, DecodeRows) and len(decodes.seqs) == num_tokens

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        decodes: DecodeRows,
        kv_caches: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """x [rows, hidden] (the embeddings), cos / sin [rows, 1, head_dim], slot_mapping [rows] int64, one decode
        per row (`takes`) -> the final norm's output [rows, hidden]; writes each row's K/V into its slot.
        Raises IndexError for a slot outside the cache (nothing written), ValueError for caches it cannot read."""
        s = self.shape
        rows = x.shape[0]
        table = self._table_for(kv_caches)
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        if x.dtype != self.dtype or cos.numel() != rows * s.head_dim or slot_mapping.dtype != torch.int64:
            raise ValueError("decode stack: inputs of another dtype or shape than the weights'")
        slots, tables = slot_mapping.contiguous(), decodes.block_tables
        out = torch.empty(rows, s.hidden, dtype=self.dtype)
        num_blocks, block_size = kv_caches[0].shape[1:3]
        args = (ctypes.byref(self._kernels), table.data_ptr(), len(self._layers), self._final_norm.data_ptr(),
                x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                tables.stride(0), decodes.seq_lens.data_ptr(), rows, s.hidden, s.num_heads, s.num_kv_heads,
                s.head_dim, s.intermediate, num_blocks, block_size, s.eps, s.head_dim**-0.5, _DTYPES[self.dtype],
                torch.get_num_threads())  # fmt: skip
        code = _KERNEL.load()(*args)  # type: ignore[misc]
        if code == 3:
            raise IndexError(f"store_kv_cache: a slot outside the cache's {num_blocks * block_size} slots")
        if code:
            raise RuntimeError(f"decoder_decode failed with code {code}")
        return out

    def _table_for(self, kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
        """The address table with these caches (rebuilt only when they moved)."""
        addresses = tuple(c.data_ptr() for c in kv_caches)
        if self._table is not None and addresses == self._kv_addresses:
            return self._table
        s, first = self.shape, kv_caches[0]
        layout = (2, *first.shape[1:3], s.num_kv_heads, s.head_dim)  # [K / V, num_blocks, block_size, heads, dims]
        if len(kv_caches) != len(self._layers) or not all(
            c.is_cpu and c.dtype == self.dtype and c.is_contiguous() and tuple(c.shape) == layout for c in kv_caches
        ):
            raise ValueError("decode stack: KV caches of another dtype or layout than the weights'")
        self._table = torch.tensor([[*a, c] for a, c in zip(self._addresses, addresses, strict=True)], dtype=torch.int64)
        self._kv_addresses = addresses
        return self._table


def _shapes(s: DecoderShape) -> dict[str, tuple[int, ...]]:
    """Each LayerWeights field's shape, in field order (the C reads them at these sizes)."""
    qkv = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    return {"input_norm": (s.hidden,), "qkv": (qkv, s.hidden), "qkv_bias": (qkv,), "q_norm": (s.head_dim,),
            "k_norm": (s.head_dim,), "o": (s.hidden, s.num_heads * s.head_dim), "post_norm": (s.hidden,),
            "gate_up": (2 * s.intermediate, s.hidden), "down": (s.hidden, s.intermediate)}  # fmt: skip


def _fields(layer: LayerWeights) -> tuple[torch.Tensor | None, ...]:
    """The layer's tensors in field order: decoder_decode.c's."""
    return tuple(getattr(layer, f.name) for f in dataclasses.fields(layer))
