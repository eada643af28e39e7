"""Pure-torch Mixture-of-Experts kernels (Qwen3-MoE / Qwen3-VL-MoE): top-k routing, the expert computation
(the specification `triton_moe.fused_moe` must match, and the CPU path) and the per-expert alignment of the
routed rows that the Triton kernel reads. Knows expert weights and routing, not the model around them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Expert GEMMs over contiguous per-expert segments of the expert-sorted rows, in one `torch._grouped_mm`
# call where the CPU build has it (exact against per-expert F.linear for fp32, bf16 and fp16). Measured on a
# 2-core CPU (64 experts, top_k 8, hidden 512, intermediate 128, fp32): as fast as the loop over experts at
# one token and faster from a few tokens up, the gap narrowing but kept at 512 tokens. Elsewhere (CUDA,
# where this file is only the forced reference) the loop over the experts that received rows runs.
_GROUPED_MM_ON_CPU: bool = hasattr(torch, "_grouped_mm")


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [num_tokens, num_experts], any float dtype -> (topk_weights [num_tokens, top_k] in
    router_logits.dtype, topk_ids [num_tokens, top_k] int64). Exactly transformers' Qwen3MoeTopKRouter:
    softmax in fp32 over the experts, top-k, divided by the top-k sum when `renormalize` (norm_topk_prob)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [num_tokens, num_experts]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [num_tokens, top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts): order [num_tokens * top_k] int64 lists the flat (token, slot) pairs
    (pair = token * top_k + slot) grouped by expert, ascending, and within an expert in pair order (a stable
    sort); counts [num_experts] int64 is how many pairs each expert received."""
    flat = topk_ids.reshape(-1)  # [num_tokens * top_k]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, k].

    hidden: [num_tokens, hidden]; w_gate_up: [num_experts, 2 * intermediate, hidden] (gate rows first, then
    up rows); w_down: [num_experts, hidden, intermediate]; both in hidden.dtype (`intermediate` may be one
    tensor-parallel rank's slice: the caller all-reduces). topk_weights: [num_tokens, top_k];
    topk_ids: [num_tokens, top_k] int64 in [0, num_experts). Returns [num_tokens, hidden] in hidden.dtype.
    Matches transformers' Qwen3MoeExperts.forward, on the CPU to the last bit.
    """
    return fused_moe_with(hidden, w_gate_up, w_down, topk_weights, topk_ids, grouped=None)


def fused_moe_with(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    grouped: bool | None,
) -> torch.Tensor:
    """`fused_moe` with the GEMM strategy forced (tests): grouped=True one torch._grouped_mm per weight,
    False a loop over the experts that received rows, None the default for the device."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden)  # [num_tokens, hidden]
    if num_tokens == 0:
        return out
    if grouped is None:
        grouped = _GROUPED_MM_ON_CPU and hidden.device.type == "cpu"
    order, counts = sort_by_expert(topk_ids, w_gate_up.shape[0])
    token = order // top_k  # [num_tokens * top_k] token of each sorted pair
    rows = hidden[token]  # [num_tokens * top_k, hidden], expert segments contiguous
    gemm = _grouped_gemm if grouped else _looped_gemm
    gate, up = gemm(rows, w_gate_up, counts).chunk(2, dim=-1)  # each [num_tokens * top_k, intermediate]
    down = gemm(F.silu(gate) * up, w_down, counts)  # [num_tokens * top_k, hidden]
    # As transformers: the routing weight in the promoted dtype, then a cast to hidden.dtype.
    down = (down * topk_weights.reshape(-1)[order, None]).to(hidden.dtype)
    # Un-permute and add up as transformers' per-expert loop does: each token's experts in ascending expert
    # order, from zero, rounding to hidden.dtype after every add. That is its fp32 and bf16 rounding exactly,
    # on any device. (One index_add_ over the sorted rows matches in fp32 on the CPU, but its bf16 version
    # accumulates in fp32 and rounds once; a plain sum over top_k adds in top-k order.)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)  # pair -> its row in `down`
    by_expert = torch.sort(topk_ids, dim=1, stable=True).indices  # [num_tokens, top_k] slots, expert order
    rows_of_token = position.view(num_tokens, top_k).gather(1, by_expert)  # [num_tokens, top_k]
    for slot in range(top_k):  # a loop over top_k, never tokens
        out = out + down[rows_of_token[:, slot]]
    return out


def _grouped_gemm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows [num_rows, k] in expert segments of `counts` rows, weight [num_experts, n, k] -> [num_rows, n]."""
    offs = counts.cumsum(0).to(torch.int32)  # [num_experts] end of each expert's segment
    return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offs)


def _looped_gemm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """As _grouped_gemm, one F.linear per expert that received rows (a loop over experts, never tokens)."""
    out = rows.new_empty(rows.shape[0], weight.shape[1])  # [num_rows, n]
    start = 0
    for expert, count in enumerate(counts.tolist()):  # one host sync for all experts
        if count:
            out[start : start + count] = F.linear(rows[start : start + count], weight[expert])
            start += count
    return out


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed pairs grouped by expert, each expert's group padded to a multiple of block_m, so every
    block of block_m sorted rows belongs to one expert. All on topk_ids' device, with no host sync: sizes are
    the upper bound num_pairs + min(num_experts, num_pairs) * (block_m - 1), rounded up to block_m.

    Returns (sorted_token_ids [max_padded] int32: flat pair index token * top_k + slot, padding rows hold
    num_pairs; expert_ids [max_padded // block_m] int32: the expert of each block (blocks past the end hold
    num_experts - 1 and must be skipped); num_tokens_post_padded [1] int32: rows actually used).
    """
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    order, counts = sort_by_expert(topk_ids, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m  # [num_experts] rows of each expert after padding
    padded_end = padded.cumsum(0)  # [num_experts]
    max_padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    sorted_experts = topk_ids.reshape(-1)[order]  # [num_pairs], ascending
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank  # [num_pairs] row of each pair after padding
    sorted_token_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(0, max_padded, block_m, device=device)  # [max_padded // block_m]
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)
    num_tokens_post_padded = padded_end[-1:].to(torch.int32)
    return sorted_token_ids, expert_ids.to(torch.int32), num_tokens_post_padded
