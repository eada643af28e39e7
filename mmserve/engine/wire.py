"""The typed messages between a front end (API server or `AsyncEngine`) and the engine core.

Down: `Hello` (once per front end), `AddRequest`, `AbortRequests`, `UtilityCall`, `Shutdown`.
Up: `Ready` (or `StartFailed`), `StepOutputs`, `RequestRejected`, `UtilityResult`.
A request's prompt ids, media and sampling params cross once (`EngineCoreRequest`); a media item whose
`mm_hash` the core still holds from this front end crosses as its hash alone (`MediaMirror`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from mmserve.encoders.vision import EncoderInput
from mmserve.engine.messages import EngineCoreOutputs, EngineInfo
from mmserve.request import MultiModalInput, PlaceholderRange, Request, SamplingParams

# Pixels each side keeps per front end for repeated media (both sides must use the same figure).
MEDIA_MIRROR_BYTES = 512 << 20


class MediaItem(msgspec.Struct, array_like=True):
    mm_hash: str
    offset: int
    length: int
    modality: str
    num_groups: int
    grid_thw: tuple[int, int, int]
    nbytes: int  # of pixel_values, for the mirrors' accounting
    pixel_values: Any = None  # [patches, patch_dim] tensor; None: the core holds it already (same hash)


class EngineCoreRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    arrival_time: float  # time.monotonic() when the server received the request
    mm_inputs: list[MediaItem] = []
    mrope_positions: Any = None  # [3, num_prompt_tokens] int64 tensor for media prompts
    mrope_delta: int = 0


# -- down ---------------------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello"):
    client_index: int
    output_address: str  # where this front end's PULL socket listens for the core's messages
    pid: int  # the front end's process: when it dies, the core aborts its requests


class AddRequest(msgspec.Struct, tag="add"):
    client_index: int
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    stopped: bool = False  # ended by a stop string in the front end (FINISHED_STOPPED), not aborted


class UtilityCall(msgspec.Struct, tag="utility"):
    client_index: int
    call_id: int
    method: str
    args: tuple[Any, ...] = ()


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


CoreInput = Hello | AddRequest | AbortRequests | UtilityCall | Shutdown


# -- up -------------------------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    info: EngineInfo


class StartFailed(msgspec.Struct, tag="start_failed"):
    message: str


class CoreDead(msgspec.Struct, tag="dead"):
    """The core's loop escaped and the core is exiting (vLLM's ENGINE_CORE_DEAD): the front end fails every
    stream now, not once it sees the process gone (after the teardown of its whole heap)."""

    reason: str  # for the front end's log, never shown to clients


class StepOutputs(msgspec.Struct, tag="outputs"):
    outputs: EngineCoreOutputs


class RequestRejected(msgspec.Struct, tag="rejected"):
    """The scheduler refused a request at admission (its error, rebuilt by the front end)."""

    request_id: str
    error_type: str  # a class name of `REJECTIONS`
    message: str
    param: str | None = None  # InvalidRequestError's
    retry_after_s: float | None = None  # SloInfeasibleError's (None: no retry can succeed)


class UtilityResult(msgspec.Struct, tag="utility_result"):
    call_id: int
    result: Any = None
    error: str | None = None


CoreOutput = Ready | StartFailed | StepOutputs | RequestRejected | UtilityResult | CoreDead


# -- requests across ---------------------------------------------------------------------------------
class MediaMirror:
    """Which pixels the other side holds, as an LRU of `capacity` bytes applied to the same items in the
    same order on both sides (ZeroMQ keeps one front end's messages in order), so the front end may send
    a repeated item as its hash and the core finds its pixels. The sender side stores sizes only."""

    def __init__(self, capacity: int = MEDIA_MIRROR_BYTES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[int, object]] = OrderedDict()
        self._bytes = 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._items

    def touch(self, mm_hash: str) -> object:
        self._items.move_to_end(mm_hash)
        return self._items[mm_hash][1]

    def put(self, mm_hash: str, nbytes: int, value: object = None) -> None:
        if nbytes > self.capacity:
            return  # never mirrored: always sent whole
        if mm_hash in self._items:  # replaced: its old size leaves, it becomes the most recent
            self._bytes -= self._items.pop(mm_hash)[0]
        while self._bytes + nbytes > self.capacity:
            _, (size, _) = self._items.popitem(last=False)
            self._bytes -= size
        self._items[mm_hash] = (nbytes, value)
        self._bytes += nbytes


def request_to_wire(request: Request, sent: MediaMirror) -> tuple[EngineCoreRequest, Callable[[], None]]:
    """The wire form, and the mirror updates to apply once it has been sent (never before: a message
    that fails to encode or send must leave the mirror as the core's)."""
    items = []
    ops: list[tuple[str, int]] = []  # (mm_hash, nbytes) to touch or put, in item order
    for mm in request.mm_inputs:
        data = mm.data
        assert isinstance(data, EncoderInput)
        nbytes = data.pixel_values.numel() * data.pixel_values.element_size()
        # Held if the mirror has it now, or an earlier item of this request puts it.
        held = mm.mm_hash in sent or any(h == mm.mm_hash and n <= sent.capacity for h, n in ops)
        pixels = None if held else data.pixel_values
        ops.append((mm.mm_hash, nbytes))
        p = mm.placeholder
        items.append(
            MediaItem(mm.mm_hash, p.offset, p.length, mm.modality, mm.num_groups, data.grid_thw, nbytes, pixels)
        )
    def commit() -> None:
        for mm_hash, nbytes in ops:
            if mm_hash in sent:
                sent.touch(mm_hash)
            else:
                sent.put(mm_hash, nbytes)

    return EngineCoreRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=request.sampling_params,
        eos_token_ids=request.eos_token_ids,
        arrival_time=request.arrival_time,
        mm_inputs=items,
        mrope_positions=request.mrope_positions,
        mrope_delta=request.mrope_delta,
    ), commit


def request_from_wire(msg: EngineCoreRequest, held: MediaMirror) -> Request:
    """Applies every item's mirror update (as the front end did), then raises KeyError if an item came
    as a hash the core does not hold."""
    mm_inputs = []
    missing = []
    for item in msg.mm_inputs:
        if item.pixel_values is None:
            data = held.touch(item.mm_hash) if item.mm_hash in held else None
            if data is None:
                missing.append(item.mm_hash)
        else:
            data = EncoderInput(item.pixel_values, tuple(item.grid_thw))  # type: ignore[arg-type]
            held.put(item.mm_hash, item.nbytes, data)
        placeholder = PlaceholderRange(item.offset, item.length)
        mm_inputs.append(MultiModalInput(item.mm_hash, placeholder, item.modality, item.num_groups, data))
    if missing:
        raise KeyError(f"media {missing} came as hashes the core does not hold")
    mrope = msg.mrope_positions
    if isinstance(mrope, torch.Tensor):
        mrope = mrope.clone()  # out of the receive buffer: it outlives the message
    request = Request(
        msg.request_id,
        msg.prompt_token_ids,
        msg.sampling_params,
        eos_token_ids=tuple(msg.eos_token_ids),
        arrival_time=msg.arrival_time,
        mm_inputs=mm_inputs,
        mrope_positions=mrope,
        mrope_delta=msg.mrope_delta,
    )
    return request
