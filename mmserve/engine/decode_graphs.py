"""Decode steps replayed from captured graphs, vLLM's CUDA graphs over batch-size buckets: static input buffers that
each pure-decode step's batch (every sequence one query row: decodes, or a prefill's one-token chunk) is copied
into, padded to the next captured size, and one graph per size sharing one memory pool. Steps with a longer
chunk or media rows run eagerly. Knows the `ForwardBatch` and the attention
backend's graph metadata; not the scheduler, the requests or the model's insides.

Pad rows are harmless by construction: each is a one-token sequence of token 0 at position 0 whose K/V goes to
the runner's scratch block (never in a plan) and whose attention reads only that slot; they are rewritten before
every replay, so a row a larger batch used before never writes a live request's slot.

Modes: "cuda" captures `torch.cuda.CUDAGraph`s; "static" (off CUDA: the tests, in Triton's interpreter) replays by
running the forward again over the same static batch object, which checks what capture needs of the forward:
that it reads its per-step inputs from the static buffers only (a host list of the capture-time batch, read by
mistake, would hold stale values and the tokens would differ from the eager engine's)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmserve.kernels.launch_plan import LaunchPlan
from mmserve.models.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

MODES = ("off", "static", "cuda")
PAD_TOKEN_ID = 0
MAX_CAPTURE_SIZE = 512


def choose_mode(device: torch.device, enforce_eager: bool, blockers: list[str]) -> str:
    """"off" under `enforce_eager` (whatever the environment says); else "cuda" on a CUDA device unless a
    `blockers` reason rules graphs out; $MMSERVE_DECODE_GRAPHS=off|static|cuda forces a mode (static or cuda where
    a blocker applies is an error)."""
    forced = os.environ.get("MMSERVE_DECODE_GRAPHS", "").strip().lower()
    if enforce_eager:
        return "off"
    if not forced:
        return "cuda" if torch.device(device).type == "cuda" and not blockers else "off"
    if forced not in MODES:
        raise ValueError(f"MMSERVE_DECODE_GRAPHS={forced!r} is not available; choose from {MODES}")
    if forced != "off" and blockers:
        raise ValueError(f"MMSERVE_DECODE_GRAPHS={forced}: decode graphs cannot run here: {'; '.join(blockers)}")
    if forced == "cuda" and torch.device(device).type != "cuda":
        raise ValueError("MMSERVE_DECODE_GRAPHS=cuda needs a CUDA device (static replays the same buffers anywhere)")
    return forced


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default buckets: 1, 2, 4, then every multiple of 8, up to max_num_seqs (at most 512; a
    max_num_seqs between multiples of 8 is a size too, so every decode batch fits one)."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return tuple(sorted({s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}))


@dataclass(frozen=True)
class _Graph:
    batch: ForwardBatch  # views of the static buffers, `size` rows; its host lists are the capture-time ones
    graph: torch.cuda.CUDAGraph | None  # None in "static" mode
    hidden: torch.Tensor | None  # [size, hidden]: the captured forward's output ("cuda" mode)


class DecodeGraphs:
    """`forward(batch) -> [num_tokens, hidden]` captured at each of `sizes` over static buffers. `metadata`:
    the attention backend's `decode_graph_metadata`, bound to the model's heads and longest context by the
    caller: (query_start_loc, seq_lens) -> what the batch carries for the attention."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        metadata: Callable[[torch.Tensor, torch.Tensor], LaunchPlan],
        *,
        mode: str,
        sizes: tuple[int, ...],
        max_blocks_per_seq: int,
        scratch_block: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        if mode not in ("static", "cuda"):
            raise ValueError(f"decode graphs: mode must be 'static' or 'cuda', got {mode!r}")
        if not sizes or min(sizes) < 1:
            raise ValueError(f"decode graphs: capture sizes must be positive, got {sizes!r}")
        self.mode, self.sizes = mode, tuple(sorted(set(sizes)))
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self._forward = forward
        self._scratch_block, self._scratch_slot = scratch_block, scratch_block * block_size
        top = self.sizes[-1]
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.full((top,), PAD_TOKEN_ID, **long)  # [top]
        self.positions = torch.zeros(3, top, **long)  # [3, top]
        self.slot_mapping = torch.full((top,), self._scratch_slot, **long)  # [top]
        self.block_tables = torch.full((top, max_blocks_per_seq), scratch_block, **long)  # [top, max_blocks]
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)  # [top + 1], constant
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)  # [top]
        self._rows = torch.arange(top, **long)
        self._graphs: dict[int, _Graph] = {}
        self.replays = dict.fromkeys(self.sizes, 0)  # steps run from each size's graph
        pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool's memory
            self._graphs[size] = self._capture(size, metadata, pool)

    def _capture(self, size: int, metadata: Callable[[torch.Tensor, torch.Tensor], LaunchPlan], pool: object) -> _Graph:
        seq_lens = self.seq_lens[:size]
        batch = ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:, :size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            logits_indices=self._rows[:size],
            query_start_loc=list(range(size + 1)),
            seq_lens=[1] * size,  # the pad rows' lengths: never read by a graph-safe backend after capture
            attention_metadata=metadata(self.query_start_loc[: size + 1], seq_lens),
        )
        if self.mode == "static":
            return _Graph(batch, None, None)
        # No autograd: a captured output with a grad_fn would keep every layer's activations in the pool for good.
        with torch.no_grad(), torch.cuda.device(self.device):
            for _ in range(2):  # warm-up outside the capture: Triton compiles, the allocator settles (pads only)
                self._forward(batch)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(batch)
        return _Graph(batch, graph, hidden)

    def size_for(self, batch: ForwardBatch) -> int | None:
        """The captured size a step's batch replays at, or None when it must run eagerly: a prefill chunk
        (a sequence with more than one query row), more sequences than the largest size, or a longer table."""
        num_seqs = len(batch.seq_lens)
        if batch.num_tokens != num_seqs or num_seqs > self.sizes[-1]:
            return None
        if batch.block_tables.shape[1] > self.max_blocks_per_seq:
            return None
        return next(s for s in self.sizes if s >= num_seqs)

    def run(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        """The hidden states [num_tokens, hidden] of a pure-decode `batch` (`size_for` gave `size`), from the
        graph of that size. The result is a view that the next replay overwrites: use it before then."""
        n, width = batch.num_tokens, batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:, :n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.block_tables[:n, :width].copy_(batch.block_tables)  # columns past a row's blocks are never read
        self.seq_lens[:n].copy_(torch.tensor(batch.seq_lens, dtype=torch.int32))
        # Pad rows [n, size): rewritten every step (a larger batch before may have left a live slot there).
        self.input_ids[n:size].fill_(PAD_TOKEN_ID)
        self.positions[:, n:size].zero_()
        self.slot_mapping[n:size].fill_(self._scratch_slot)
        self.block_tables[n:size].fill_(self._scratch_block)
        self.seq_lens[n:size].fill_(1)
        graph = self._graphs[size]
        self.replays[size] += 1
        if graph.graph is None:  # static mode: the same batch object, run again
            return self._forward(graph.batch)[:n]
        with torch.cuda.device(self.device):
            graph.graph.replay()
        assert graph.hidden is not None
        return graph.hidden[:n]
