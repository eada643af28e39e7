"""msgpack (msgspec) encoding of the engine core's messages, with tensors as out-of-band frames.

`encode(obj)` returns a list of frames for one ZeroMQ multipart message: frame 0 is the msgpack body;
every tensor in it becomes a msgpack extension holding (dtype, shape, frame index), and its bytes
travel as a frame of their own, never copied into the body nor pickled. `Decoder(type).decode(frames)`
rebuilds the typed value; its tensors are views of the received frames (zero-copy, read-only use).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

_TENSOR_EXT = 1
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip
_header = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], int])

Frame = bytes | memoryview


class Encoder:
    """Not thread-safe: one per sending thread (or guarded by the sender's lock)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[Frame] = []

    def encode(self, obj: Any) -> list[Frame]:
        self._frames = [b""]
        try:
            self._frames[0] = self._encoder.encode(obj)
            return self._frames
        finally:
            self._frames = []

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            name = str(obj.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise TypeError(f"tensors of dtype {obj.dtype} do not cross the engine boundary")
            tensor = obj.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            tensor = tensor.contiguous()
            # Bytes of the tensor itself (uint8 view; numpy has no bfloat16), kept alive by the frame.
            data = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
            self._frames.append(memoryview(data) if len(data) else b"")
            header = (name, tuple(tensor.shape), len(self._frames) - 1)
            return msgspec.msgpack.Ext(_TENSOR_EXT, _header.encode(header))
        raise TypeError(f"{type(obj).__name__} does not cross the engine boundary")


class Decoder:
    def __init__(self, type_: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook)
        self._frames: Sequence[Frame] = ()

    def decode(self, frames: Sequence[Any]) -> Any:
        """`frames`: bytes, memoryviews or zmq Frames (their buffers are used without a copy)."""
        self._frames = [f.buffer if hasattr(f, "buffer") else f for f in frames]
        try:
            return self._decoder.decode(self._frames[0])
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != _TENSOR_EXT:
            raise msgspec.ValidationError(f"unknown extension type {code}")
        name, shape, index = _header_decoder.decode(data)
        dtype = _DTYPES[name]
        buffer = self._frames[index]
        if not len(buffer):
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # a received frame is read-only; its tensors are never written
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buffer, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape)
