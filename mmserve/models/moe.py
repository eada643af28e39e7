"""The sparse MLP of Qwen3-MoE / Qwen3-VL-MoE layers: a replicated router picks `top_k` experts per token,
the experts run as one grouped operation (`kernels/moe.py` or its Triton twin), and, under tensor
parallelism, each rank holds a slice of every expert's intermediate columns (the dense MLP's split) and
the partial outputs are summed by one all-reduce.

Loads every expert layout a checkpoint may have: one tensor per expert and projection (the hub's
Qwen3-MoE: `experts.{e}.gate_proj.weight` [I, H]), fused as transformers 5.x keeps them
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), or fused and transposed as the hub's
Qwen3-VL-MoE stores them ([E, H, 2I], [E, I, H]). Knows nothing of requests."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.distributed.group import TensorParallelGroup
from mmserve.kernels.moe import select_experts
from mmserve.models.config import DecoderConfig
from mmserve.models.parallel import SliceReader, split_evenly

# (hidden, w_gate_up, w_down, topk_weights, topk_ids) -> [num_tokens, hidden]
FusedMoE = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """This rank's slice of every expert: gate_up_proj [E, 2 * I_rank, H] ([gate | up] rows),
    down_proj [E, H, I_rank]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.part = split_evenly(intermediate_size, tp.rank, tp.world_size, "moe_intermediate_size")
        n, local = num_experts, self.part.length
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * local, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n, hidden_size, local))
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self._loaded: set[tuple[str, int]] = set()  # (projection, expert) filled so far

    def load_weight(self, name: str, shape: tuple[int, ...], read: SliceReader, part: int | None) -> None:
        """`name`: "gate_up_proj" / "down_proj" (all experts at once, `part` None) or "gate_proj" /
        "up_proj" / "down_proj" of expert `part` (per-expert checkpoints, a [rows, cols] weight)."""
        p, h, i_full = self.part, self.hidden_size, self.part.size
        with torch.no_grad():
            if part is not None:
                if name not in EXPERT_PROJECTIONS or not 0 <= part < self.num_experts:
                    raise ValueError(f"{name} of expert {part}: no such expert weight")
                if name == "down_proj":
                    _check(shape, (h, i_full), name)
                    self.down_proj[part].copy_(read(1, p.start, p.length))
                else:
                    _check(shape, (i_full, h), name)
                    rows = slice(0, p.length) if name == "gate_proj" else slice(p.length, 2 * p.length)
                    self.gate_up_proj[part, rows].copy_(read(0, p.start, p.length))
                self._loaded.add((name, part))
                return
            e = self.num_experts
            if name == "gate_up_proj":
                if tuple(shape) == (e, 2 * i_full, h):  # transformers 5.x: [E, 2I, H]
                    gate, up = read(1, p.start, p.length), read(1, i_full + p.start, p.length)
                    self.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
                elif tuple(shape) == (e, h, 2 * i_full):  # the hub's Qwen3-VL-MoE: [E, H, 2I]
                    gate, up = read(2, p.start, p.length), read(2, i_full + p.start, p.length)
                    self.gate_up_proj.copy_(torch.cat([gate, up], dim=2).transpose(1, 2))
                else:
                    raise ValueError(f"{name}: checkpoint shape {tuple(shape)} is neither {(e, 2 * i_full, h)} "
                                     f"nor {(e, h, 2 * i_full)}")  # fmt: skip
                self._loaded.update(("gate_proj", x) for x in range(e))
                self._loaded.update(("up_proj", x) for x in range(e))
            elif name == "down_proj":
                if tuple(shape) == (e, h, i_full):
                    self.down_proj.copy_(read(2, p.start, p.length))
                elif tuple(shape) == (e, i_full, h):
                    self.down_proj.copy_(read(1, p.start, p.length).transpose(1, 2))
                else:
                    raise ValueError(f"{name}: checkpoint shape {tuple(shape)} is neither {(e, h, i_full)} "
                                     f"nor {(e, i_full, h)}")  # fmt: skip
                self._loaded.update(("down_proj", x) for x in range(e))
            else:
                raise ValueError(f"{name}: not an expert weight")

    def missing(self) -> list[str]:
        """Expert weights no checkpoint tensor has filled, as `{projection}#{expert}`."""
        return [
            f"{proj}#{e}"
            for e in range(self.num_experts)
            for proj in EXPERT_PROJECTIONS
            if (proj, e) not in self._loaded
        ]


def _check(shape: tuple[int, ...], expected: tuple[int, ...], name: str) -> None:
    if tuple(shape) != expected:
        raise ValueError(f"{name}: checkpoint shape {tuple(shape)} != expert shape {expected}")


class SparseMoE(nn.Module):
    """Router `gate` [E, H] (replicated; fp32 softmax, top-k, optional renormalisation) and `experts`."""

    def __init__(self, cfg: DecoderConfig, tp: TensorParallelGroup, fused_moe: FusedMoE) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, tp)
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.tp, self.fused_moe = tp, fused_moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, hidden], summed over ranks."""
        # F.linear, as transformers' router: its rounding decides near-tied expert choices.
        router_logits = F.linear(x, self.gate.weight)  # [num_tokens, num_experts]
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = self.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, topk_weights, topk_ids)
        return out if self.tp.world_size == 1 else self.tp.all_reduce(out.contiguous())
