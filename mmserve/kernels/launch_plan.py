"""The Triton attention's launch plan of one batch (its device metadata and query tiling), kept free of triton so
that the forward batch can carry one: built per step from the host lists (`triton_attention.make_launch_plan`),
or once over static device buffers that a captured decode graph reads (`triton_attention.decode_graph_plan`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LaunchPlan:
    """Device metadata and query tiling of one batch, shared by every layer of a step."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    work_seq: torch.Tensor  # [num_work] int32, longest key range first (so the tail of the grid is short)
    work_tile: torch.Tensor  # [num_work] int32
    num_work: int
    block_m: int
    block_q: int  # query tokens per tile: block_m // group
    num_splits: int
