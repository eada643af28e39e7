"""The device batch of one step: flat token tensors plus the paged-attention metadata.

Built by the model runner from a `SchedulerOutput`; passed explicitly to every layer (no global context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.kernels.launch_plan import LaunchPlan
from mmserve.kernels.reference import DecodeRows


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [3, num_tokens] int64: M-RoPE (t, h, w); equal rows for text
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each token's K/V is written
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    logits_indices: torch.Tensor  # [num_sampled] int64: rows whose next-token logits are sampled
    # Host-side copies, so kernels that loop over sequences never sync with the device.
    query_start_loc: list[int]  # [num_seqs + 1]: sequence i owns token rows [q[i], q[i + 1])
    seq_lens: list[int]  # [num_seqs]: context length after this step (cached + new tokens)
    # What the attention backend reads beside the lists, built once for every layer of the step (None: each
    # layer's call builds its own): the decodes' rows (torch, cpu) or a launch plan over device buffers (triton).
    attention_metadata: DecodeRows | LaunchPlan | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
