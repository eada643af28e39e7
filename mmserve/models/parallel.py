"""Linear and embedding layers that hold one tensor-parallel rank's slice of a weight (vLLM's recipe),
and how each loads its slice from a checkpoint tensor without reading the rest.

- `ColumnParallelLinear`: output rows split over ranks (QKV by heads, gate/up by halves); no
  communication. A fused layer keeps its parts one after another: [q | k | v] or [gate | up].
- `RowParallelLinear`: input columns split; partial products summed by one all-reduce, the bias added
  once after it.
- `VocabParallelEmbedding` / `ParallelLMHead`: vocabulary rows split (padded to a multiple of the
  rank count); lookups all-reduced, logits gathered to the first rank.

With one rank every layer is the plain layer with the same parameter names. Knows nothing of requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.distributed.group import TensorParallelGroup
from mmserve.kernels.cpu_linear import BLAS_PATHS, LinearPaths
from mmserve.models.config import DecoderConfig

# Reads part of a checkpoint tensor: (dim, start, length) -> that slice; only its bytes are read.
SliceReader = Callable[[int, int, int], torch.Tensor]


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose products run through `linear_paths`: on the CPU, each row
    count up to cpu_linear.MAX_ROWS (a decode batch) takes the product measured fastest for this model on this
    machine (`kernels/cpu_linear.py`; the runner sets the measured paths); F.linear elsewhere. The result
    equals x @ W^T up to float rounding order. Replicated on every rank."""

    linear_paths: LinearPaths = BLAS_PATHS  # the model's measured paths once the runner sets them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_paths.linear(x, self.weight, self.bias)

    def load_weight(self, name: str, shape: tuple[int, ...], read: SliceReader, part: int | None) -> None:
        """Copy checkpoint tensor `name` ("weight" | "bias") of `shape` into this layer's slice."""
        if part is not None:
            raise ValueError(f"{name}: a replicated layer has no parts")
        _copy_full(getattr(self, name), shape, read, name)


def _copy_full(param: torch.Tensor, shape: tuple[int, ...], read: SliceReader, name: str) -> None:
    if tuple(param.shape) != tuple(shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(shape)} != model shape {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(read(0, 0, shape[0]))


@dataclass(frozen=True)
class OutputPart:
    """One part of a column-parallel layer's output rows, as this rank holds it."""

    size: int  # rows of the whole part in the checkpoint
    start: int  # first checkpoint row (within the part) this rank holds
    length: int  # rows this rank holds


def split_evenly(size: int, rank: int, world_size: int, what: str) -> OutputPart:
    if size % world_size:
        raise ValueError(f"{what} ({size}) does not split over {world_size} tensor-parallel ranks")
    length = size // world_size
    return OutputPart(size, rank * length, length)


def kv_head_range(num_heads: int, num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first KV head, KV heads) `rank` holds. With more ranks than KV heads each rank holds the one
    KV head its query heads read (replicated over world_size / num_kv_heads ranks)."""
    n = world_size
    if num_heads % n:
        raise ValueError(f"{num_heads} attention heads do not split over {n} tensor-parallel ranks")
    if n <= num_kv_heads:
        if num_kv_heads % n:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {n} tensor-parallel ranks")
        per_rank = num_kv_heads // n
        return rank * per_rank, per_rank
    if n % num_kv_heads:
        raise ValueError(
            f"{n} tensor-parallel ranks cannot share {num_kv_heads} KV heads (ranks must be a multiple of them)"
        )
    return rank // (n // num_kv_heads), 1


def check_tensor_parallel(cfg: DecoderConfig, world_size: int) -> None:
    """Raises ValueError, naming the shape, if the decoder cannot be split over `world_size` ranks;
    called before any rank starts."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    kv_head_range(cfg.num_heads, cfg.num_kv_heads, 0, world_size)
    if len(cfg.moe_layers) < cfg.num_layers:  # some layer keeps the dense MLP
        split_evenly(cfg.intermediate_size, 0, world_size, "intermediate_size")
    if cfg.moe_layers:  # every rank holds a slice of each expert's columns
        split_evenly(cfg.moe_intermediate_size, 0, world_size, "moe_intermediate_size")


class ColumnParallelLinear(Linear):
    """Holds `parts` (output rows of one or several fused projections) of this rank, in order."""

    def __init__(self, in_features: int, parts: list[OutputPart], bias: bool) -> None:
        super().__init__(in_features, sum(p.length for p in parts), bias=bias)
        self.parts = parts

    def load_weight(self, name: str, shape: tuple[int, ...], read: SliceReader, part: int | None) -> None:
        """`part`: which fused projection the checkpoint tensor is (q/k/v, gate/up); None when the
        checkpoint stores the fused tensor itself ([q | k | v] rows)."""
        param = getattr(self, name)
        if part is not None and not 0 <= part < len(self.parts):
            raise ValueError(f"{name}: part {part} of a layer with {len(self.parts)} parts")
        indices = range(len(self.parts)) if part is None else [part]
        expected = sum(self.parts[i].size for i in indices)
        if shape[0] != expected or tuple(shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(shape)} != model shape ({expected}, *{tuple(param.shape[1:])})"
            )
        with torch.no_grad():
            ckpt_offset = 0
            for i in indices:
                p = self.parts[i]
                local = sum(q.length for q in self.parts[:i])
                param.narrow(0, local, p.length).copy_(read(0, ckpt_offset + p.start, p.length))
                ckpt_offset += p.size


class RowParallelLinear(Linear):
    """Holds this rank's input columns; `forward` returns the full, all-reduced output."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup) -> None:
        self.in_part = split_evenly(in_features, tp.rank, tp.world_size, "input features of a row-parallel layer")
        super().__init__(self.in_part.length, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.linear_paths.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(self.linear_paths.linear(x, self.weight, None).contiguous())
        return out if self.bias is None else out + self.bias  # the bias once, not once per rank

    def load_weight(self, name: str, shape: tuple[int, ...], read: SliceReader, part: int | None) -> None:
        if part is not None:
            raise ValueError(f"{name}: a row-parallel layer has no parts")
        if name == "bias":
            _copy_full(self.bias, shape, read, name)
            return
        expected = (self.out_features, self.in_part.size)
        if tuple(shape) != expected:
            raise ValueError(f"{name}: checkpoint shape {tuple(shape)} != model shape {expected}")
        with torch.no_grad():
            self.weight.copy_(read(1, self.in_part.start, self.in_part.length))


def vocab_rows(vocab_size: int, tp: TensorParallelGroup) -> tuple[int, int]:
    """(first vocabulary row, rows per rank): the vocabulary padded to a multiple of the rank count."""
    per_rank = -(-vocab_size // tp.world_size)
    return tp.rank * per_rank, per_rank


def _load_vocab_rows(param: torch.Tensor, shape: tuple[int, ...], read: SliceReader, vocab_size: int,
                     first: int, name: str) -> None:  # fmt: skip
    if shape[0] != vocab_size or tuple(shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"{name}: checkpoint shape {tuple(shape)} != model shape ({vocab_size}, *{tuple(param.shape[1:])})")
    held = max(0, min(param.shape[0], vocab_size - first))
    with torch.no_grad():
        param.zero_()  # padding rows past the vocabulary stay zero
        if held:
            param.narrow(0, 0, held).copy_(read(0, first, held))


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        self.first_row, per_rank = vocab_rows(vocab_size, tp)
        super().__init__(per_rank, hidden_size)
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [num_tokens] -> [num_tokens, hidden], summed over ranks (each embeds the ids it holds)."""
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.first_row
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def load_weight(self, name: str, shape: tuple[int, ...], read: SliceReader, part: int | None) -> None:
        _load_vocab_rows(self.weight, shape, read, self.vocab_size, self.first_row, name)


class ParallelLMHead(Linear):
    """The output projection over this rank's vocabulary rows (may share its weight with the embedding)."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallelGroup) -> None:
        self.first_row, per_rank = vocab_rows(vocab_size, tp)
        super().__init__(hidden_size, per_rank, bias=False)
        self.vocab_size, self.tp = vocab_size, tp

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [num_rows, hidden] -> fp32 logits [num_rows, vocab] on the first rank, None elsewhere."""
        local = self(hidden).float()  # [num_rows, rows of this rank]
        if self.tp.world_size == 1:
            return local
        gathered = self.tp.gather_to_first(local, dim=-1)  # [num_rows, padded vocab] on the first rank
        return None if gathered is None else gathered[:, : self.vocab_size]

    def load_weight(self, name: str, shape: tuple[int, ...], read: SliceReader, part: int | None) -> None:
        _load_vocab_rows(self.weight, shape, read, self.vocab_size, self.first_row, name)
