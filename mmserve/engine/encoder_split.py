"""A step's encoder work as runs (consecutive temporal groups of one item, encoded in one call), and
how tensor-parallel ranks share it in the vision tower's data mode: contiguous stretches of the plan's
work balanced by embedding tokens (patches / merge**2). A pure function of the plan: every rank
computes the same split. Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mmserve.request import MultiModalInput
from mmserve.scheduler.output import EncoderWork


@dataclass(frozen=True)
class EncoderRun:
    """Temporal groups first..first + count - 1 of one item."""

    mm_input: MultiModalInput
    first: int
    count: int

    @property
    def num_tokens(self) -> int:
        return self.count * self.mm_input.tokens_per_group


def encoder_runs(work: Sequence[EncoderWork]) -> list[EncoderRun]:
    runs: list[EncoderRun] = []
    for w in work:
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.mm_input.mm_hash == w.mm_input.mm_hash
            and w.group == last.first + last.count
        ):
            runs[-1] = EncoderRun(last.mm_input, last.first, last.count + 1)
        else:
            runs.append(EncoderRun(w.mm_input, w.group, 1))
    return runs


def split_encoder_work(work: Sequence[EncoderWork], world_size: int) -> list[list[EncoderRun]]:
    """Rank r's runs at index r. Each rank takes the next stretch of work until its share of the
    step's embedding tokens is reached (a group goes where its midpoint falls); ranks past the work
    get nothing (one image over two ranks: the second is idle)."""
    total = sum(w.mm_input.tokens_per_group for w in work)
    shares: list[list[EncoderWork]] = [[] for _ in range(world_size)]
    rank, done = 0, 0
    for w in work:
        tokens = w.mm_input.tokens_per_group
        while rank < world_size - 1 and (2 * done + tokens) * world_size > 2 * total * (rank + 1):
            rank += 1
        shares[rank].append(w)
        done += tokens
    return [encoder_runs(share) for share in shares]
