"""What the first tensor-parallel rank sends the others, as typed msgspec messages: each step's
incremental plan (`RankPlan`), the control calls that must reach every rank in step order, and what
the ranks say back (`RankReady`, `RankFailed`).

A plan's body is encoded once and the same frames go to every rank; media metadata crosses with the
plan, and each rank's extra frames hold the pixels of only the temporal groups it encodes this step
(data mode), so no pixel crosses twice. Everything else the runner needs it keeps from earlier plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from mmserve.encoders.vision import EncoderInput
from mmserve.engine.encoder_split import EncoderRun, encoder_runs, split_encoder_work
from mmserve.engine.serial import Decoder, Encoder, Frame
from mmserve.request import MultiModalInput, PlaceholderRange, SamplingParams
from mmserve.scheduler.output import EncoderWork, NewRequestData, ScheduledRequest, SchedulerOutput


class Media(msgspec.Struct, array_like=True, frozen=True):
    mm_hash: str
    offset: int
    length: int
    modality: str
    num_groups: int


class NewRequest(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    mm_inputs: list[Media]
    mrope_positions: torch.Tensor | None
    mrope_delta: int


class Pixels(msgspec.Struct, array_like=True, frozen=True):
    """Patch rows of temporal groups first_group.. of one item (`EncoderInput` with `first_group`)."""

    mm_hash: str
    grid_thw: tuple[int, int, int]
    first_group: int
    pixel_values: torch.Tensor


class RankPlan(msgspec.Struct, tag=True, array_like=True, frozen=True):
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    new_requests: list[NewRequest]
    encoder_media: list[Media]  # every item named in encoder_work
    # (mm_hash, group, blocks), in plan order; blocks: a slice of the tower (weights mode only), else None
    encoder_work: list[tuple[str, int, tuple[int, int, int] | None]]
    freed_encoder_keys: list[tuple[str, int]]
    finished_request_ids: list[str]
    preempted_request_ids: list[str]


class RankPixels(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Sent to one rank right before a plan: the pixels it encodes in that plan's step."""

    pixels: list[Pixels]


class ResetEncoderCache(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


class InjectFaults(msgspec.Struct, tag=True, array_like=True, frozen=True):
    action: str
    request_ids: list[str]


class ReportHeldState(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """Asks a rank for its `RankHeldState` (leak checks), answered on the reply channel."""


class StopRank(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


RankInput = RankPlan | RankPixels | ResetEncoderCache | InjectFaults | ReportHeldState | StopRank


class RankReady(msgspec.Struct, tag=True, array_like=True, frozen=True):
    rank: int
    pid: int
    fingerprint: str  # of the checkpoint it loaded (`rank_worker.checkpoint_fingerprint`)


class RankFailed(msgspec.Struct, tag=True, array_like=True, frozen=True):
    rank: int
    message: str


class RankHeldState(msgspec.Struct, tag=True, array_like=True, frozen=True):
    rank: int
    num_requests: int
    encoder_keys: list[tuple[str, int]]


RankOutput = RankReady | RankFailed | RankHeldState


def _media(mm: MultiModalInput) -> Media:
    return Media(mm.mm_hash, mm.placeholder.offset, mm.placeholder.length, mm.modality, mm.num_groups)


def _media_input(media: Media, data: object = None) -> MultiModalInput:
    placeholder = PlaceholderRange(media.offset, media.length)
    return MultiModalInput(media.mm_hash, placeholder, media.modality, media.num_groups, data)


def _pixels(runs: list[EncoderRun]) -> list[Pixels]:
    """Patch rows of each run's groups (runs of one item are merged by `encoder_runs`)."""
    pixels = []
    for run in runs:
        data = run.mm_input.data
        rows, _ = data.groups(run.first, run.first + run.count - 1)  # type: ignore[attr-defined]
        grid = tuple(data.grid_thw)  # type: ignore[attr-defined]
        pixels.append(Pixels(run.mm_input.mm_hash, grid, run.first, rows))  # type: ignore[arg-type]
    return pixels


class PlanEncoder:
    """Encodes plans on the first rank: `encode(plan)` -> the shared frames and, per other rank, the
    frames of its pixels (None when it encodes nothing this step). Not thread-safe."""

    def __init__(self, world_size: int, shard_encoder: bool = False) -> None:
        """`shard_encoder`: the vision tower's weights mode (every rank encodes every item)."""
        self.world_size = world_size
        self.shard_encoder = shard_encoder
        self._encoder = Encoder()

    def encode(self, plan: SchedulerOutput) -> tuple[list[Frame], list[list[Frame] | None]]:
        media: dict[str, Media] = {}
        for w in plan.encoder_work:
            media.setdefault(w.mm_input.mm_hash, _media(w.mm_input))
        body = RankPlan(
            list(plan.scheduled),
            plan.num_scheduled_tokens,
            [
                NewRequest(
                    n.request_id,
                    list(n.prompt_token_ids),
                    n.sampling_params,
                    [_media(mm) for mm in n.mm_inputs],
                    n.mrope_positions,  # type: ignore[arg-type]
                    n.mrope_delta,
                )
                for n in plan.new_requests
            ],
            list(media.values()),
            [(w.mm_input.mm_hash, w.group, w.blocks) for w in plan.encoder_work],
            list(plan.freed_encoder_keys),
            sorted(plan.finished_request_ids),
            sorted(plan.preempted_request_ids),
        )
        shared = list(self._encoder.encode(body))
        per_rank: list[list[Frame] | None] = [None] * self.world_size
        if not plan.encoder_work:
            return shared, per_rank
        if self.shard_encoder:  # the same pixels for every rank: all but those of slices that continue a group
            # Runs as the runner forms them: of the whole groups, and apart, of the slices that start a group.
            whole = [w for w in plan.encoder_work if w.blocks is None]
            starts = [w for w in plan.encoder_work if w.blocks is not None and w.blocks[0] == 0]
            if not whole and not starts:
                return shared, per_rank
            pixels = _pixels(encoder_runs(whole)) + _pixels(encoder_runs(starts))
            frames = list(self._encoder.encode(RankPixels(pixels)))
            return shared, [None] + [frames] * (self.world_size - 1)
        shares = split_encoder_work(plan.encoder_work, self.world_size)
        for rank in range(1, self.world_size):
            if shares[rank]:
                per_rank[rank] = list(self._encoder.encode(RankPixels(_pixels(shares[rank]))))
        return shared, per_rank

    def encode_control(self, message: Any) -> list[Frame]:
        return list(self._encoder.encode(message))


class PlanDecoder:
    """Rebuilds messages on the other ranks; a `RankPlan` becomes the `SchedulerOutput` the first rank
    ran, with pixels only for the groups this rank encodes (from the `RankPixels` before it)."""

    def __init__(self) -> None:
        self._decoder = Decoder(RankInput)
        self._pixels: list[Pixels] = []

    def decode(self, frames: Sequence[Any]) -> Any:
        """-> a `SchedulerOutput`, a control message, or None (pixels kept for the next plan)."""
        message = self._decoder.decode(frames)
        if isinstance(message, RankPixels):
            self._pixels = list(message.pixels)
            return None
        if not isinstance(message, RankPlan):
            return message
        pixels, self._pixels = self._pixels, []
        media = {m.mm_hash: m for m in message.encoder_media}
        # (mm_hash, group) -> the item with the pixels that hold that group here (one object per run sent:
        # one item's groups may come as several runs); groups this rank does not encode get no pixels.
        items: dict[tuple[str, int], MultiModalInput] = {}
        for p in pixels:
            item = _media_input(media[p.mm_hash], EncoderInput(p.pixel_values, p.grid_thw, p.first_group))
            _, h, w = p.grid_thw
            for group in range(p.first_group, p.first_group + p.pixel_values.shape[0] // (h * w)):
                items[(p.mm_hash, group)] = item
        bare = {h: _media_input(m) for h, m in media.items()}
        return SchedulerOutput(
            scheduled=tuple(message.scheduled),
            num_scheduled_tokens=message.num_scheduled_tokens,
            new_requests=tuple(
                NewRequestData(
                    n.request_id,
                    tuple(n.prompt_token_ids),
                    n.sampling_params,
                    tuple(_media_input(m) for m in n.mm_inputs),
                    n.mrope_positions,
                    n.mrope_delta,
                )
                for n in message.new_requests
            ),
            encoder_work=tuple(EncoderWork(items.get((h, g), bare[h]), g, blocks=b) for h, g, b in message.encoder_work),
            freed_encoder_keys=tuple(tuple(k) for k in message.freed_encoder_keys),  # type: ignore[misc]
            finished_request_ids=frozenset(message.finished_request_ids),
            preempted_request_ids=frozenset(message.preempted_request_ids),
        )
