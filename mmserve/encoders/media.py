"""Decodes untrusted media into RGB pixels under `MediaLimits`: images with Pillow, videos with PyAV.

Owns format detection by content, data URLs, the byte/pixel/frame/duration caps, fps sampling and the
user-facing error messages. Knows nothing of models, preprocessing, torch or the engine.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import struct
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import BinaryIO

import av
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from mmserve.errors import InvalidRequestError

# Pillow plugin ids tried when opening an image: detection is by content, never by file name.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
# First box types an ISO-BMFF file (mp4 / mov / m4v / 3gp) may start with.
_BMFF_BOXES = {b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot", b"uuid"}
_EBML_MAGIC = b"\x1a\x45\xdf\xa3"  # Matroska and WebM
# Decoded frames tolerated per second of allowed duration: stops files whose timestamps never advance.
_MAX_DECODED_FPS = 1000
_PIL_FILTERS = frozenset(range(6))  # NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING
_MAX_TOP_BOXES = 4096  # top-level ISO-BMFF boxes walked looking for moov before giving up
_MAX_MOOV_BYTES = 64 * 2**20  # a moov read whole to find the track matrices; larger: decode instead


@dataclass(frozen=True)
class MediaLimits:
    """Caps on one media item (and on items per prompt). Validated once at construction."""

    max_image_pixels: int = 50_000_000  # width * height, checked from the header before decoding
    max_image_bytes: int = 20 * 2**20  # encoded size
    max_video_bytes: int = 256 * 2**20  # encoded size
    max_video_frames: int = 768  # frames kept after sampling; longer clips are sampled more sparsely
    max_video_duration_s: float = 1800.0
    max_video_pixels_per_frame: int = 1920 * 1088
    video_fps: float = 2.0  # target sampling rate for decoded videos
    max_items_per_prompt: int = 32  # images + videos of one prompt
    # Isolation (encoders/decode_pool.py): worker processes, and each item's wall-clock and memory budget.
    decode_workers: int = 2  # worker processes decoding at once; more requests wait for a free one
    decode_timeout_s: float = 30.0  # a worker still busy after this is killed and replaced
    decode_memory_mib: int = 4096  # address space a worker may add to its idle size (RLIMIT_AS)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            ok_type = isinstance(value, int) if f.type == "int" else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok_type or not (value > 0 and math.isfinite(value)):
                raise InvalidRequestError(
                    f"{f.name}: must be a positive {f.type}, got {value!r}", param=f.name
                )


DEFAULT_LIMITS = MediaLimits()


@dataclass(frozen=True, eq=False)
class DecodedVideo:
    """Sampled RGB frames of one video and their timing."""

    frames: np.ndarray  # [T, H, W, 3] uint8, T >= 1
    fps: float  # rate of the sampled frames: frame k sits at about k / fps seconds
    source_fps: float  # the container's frame rate (for an array: the rate it was declared with)
    duration_s: float  # of the whole source clip, not only of the sampled frames
    timestamps_s: tuple[float, ...]  # [T] presentation time of each sampled frame, from the first frame

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


@dataclass(frozen=True)
class VideoPlan:
    """What `load_video` returns for a source under the same `MediaLimits`, known from its container
    headers (at most its first frame decoded, none converted to pixels): a video's token budget is fixed
    before its frames are. `load_video` returns exactly `num_frames` frames of `height` x `width` (or of
    `resize_to`), at `fps`."""

    width: int  # of each returned frame, upright (display rotation applied), before any resize_to
    height: int
    num_frames: int  # T of load_video's [T, H, W, 3], >= 1
    fps: float  # as DecodedVideo.fps
    source_fps: float  # as DecodedVideo.source_fps
    duration_s: float  # as DecodedVideo.duration_s
    timestamps_s: tuple[float, ...] | None = None  # [T]; only for arrays (a file's are known once decoded)


def check_items_per_prompt(
    num_items: int, limits: MediaLimits = DEFAULT_LIMITS, *, param: str | None = None
) -> None:
    """Raise if one prompt carries more images + videos than `limits.max_items_per_prompt`."""
    if num_items > limits.max_items_per_prompt:
        raise InvalidRequestError(
            f"prompt has {num_items} media items; at most {limits.max_items_per_prompt} are allowed "
            "(max_items_per_prompt)",
            param=param,
        )


# ---------------------------------------------------------------------------------------------- images


def load_image(
    source: Image.Image | bytes | bytearray | memoryview | str | Path,
    limits: MediaLimits = DEFAULT_LIMITS,
    *,
    item: str = "image",
    param: str | None = None,
) -> Image.Image:
    """Decode `source` (PIL image, encoded bytes, data URL or local path) into an RGB image.

    EXIF orientation is applied, transparency is composited on white, an animated file gives its first
    frame. Any failure raises `InvalidRequestError` naming `item`.
    """

    def fail(message: str) -> InvalidRequestError:
        return InvalidRequestError(f"{item}: {message}", param=param)

    if isinstance(source, Image.Image):
        img = source
    else:
        data = _read_source(source, limits.max_image_bytes, "max_image_bytes", "image", fail)
        img = _open_image(data, limits, fail)
    w, h = img.size
    if w < 1 or h < 1:
        raise fail(f"has an empty size {w}x{h}")
    if w * h > limits.max_image_pixels:  # from the header: nothing has been decoded yet
        raise fail(
            f"{w}x{h} = {w * h} pixels exceeds the limit of {limits.max_image_pixels} (max_image_pixels)"
        )
    try:
        img.load()  # an animated GIF / WEBP / APNG stays on frame 0, its first frame
        img = ImageOps.exif_transpose(img)
        return _to_rgb(img)
    except MemoryError:
        raise  # the decode pool reports it as the memory limit, not as corrupt data
    except Image.DecompressionBombError as exc:
        raise fail(f"exceeds the pixel limit of {limits.max_image_pixels} (max_image_pixels)") from exc
    except Exception as exc:  # decoders raise OSError, SyntaxError, struct.error...; none is echoed
        raise fail("could not be decoded (corrupt or truncated image data)") from exc


def _open_image(data: bytes, limits: MediaLimits, fail: Callable[[str], InvalidRequestError]) -> Image.Image:
    """Read only the header: the pixel check must happen before any pixel is allocated."""
    try:
        return Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:  # Pillow's own guard (> 2 * Image.MAX_IMAGE_PIXELS)
        raise fail(f"exceeds the pixel limit of {limits.max_image_pixels} (max_image_pixels)") from exc
    except MemoryError:
        raise
    except UnidentifiedImageError as exc:
        raise fail(f"is not a supported image format (supported: {', '.join(IMAGE_FORMATS)})") from exc
    except Exception as exc:
        raise fail("could not be decoded (corrupt image header)") from exc


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        # 16-bit greyscale PNG: Pillow's convert would clip at 255 instead of scaling down.
        grey = (np.asarray(img).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8)
        img = Image.fromarray(grey, mode="L")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        white.alpha_composite(rgba)
        return white.convert("RGB")
    return img.convert("RGB")


# ---------------------------------------------------------------------------------------------- videos


def load_video(
    source: str | Path | bytes | bytearray | memoryview | np.ndarray,
    limits: MediaLimits = DEFAULT_LIMITS,
    *,
    item: str = "video",
    param: str | None = None,
    array_fps: float | None = None,
    resize_to: tuple[int, int] | None = None,
    resample: int = 3,
) -> DecodedVideo:
    """Decode `source` (encoded bytes, data URL, local path, or a uint8 array) into sampled RGB frames.

    A `[T, H, W, 3]` uint8 array is used frame for frame (no resampling) at `array_fps` (default
    `limits.video_fps`). Files are decoded with PyAV and sampled uniformly in time at `limits.video_fps`,
    more sparsely when that would exceed `limits.max_video_frames`; `plan_video` says beforehand how many
    frames come back. With `resize_to` = (height, width), each kept frame is resized with Pillow
    (`Image.resize((width, height), resample)`, as preprocessing would) right after it is decoded, so no
    full-resolution frame is ever stored. Any failure raises `InvalidRequestError` naming `item`.
    """

    def fail(message: str) -> InvalidRequestError:
        return InvalidRequestError(f"{item}: {message}", param=param)

    check_resize(resize_to, resample)
    if isinstance(source, np.ndarray):
        video = _video_from_array(source, limits, array_fps, fail)
        if resize_to is not None and video.frames.shape[1:3] != tuple(resize_to):
            frames = np.empty((video.num_frames, *resize_to, 3), np.uint8)
            for i, frame in enumerate(video.frames):
                frames[i] = _resize(frame, resize_to, resample)
            video = DecodedVideo(frames, video.fps, video.source_fps, video.duration_s, video.timestamps_s)
        return video
    source_ = _open_video_source(source, limits, fail)
    return _decode_video(source_, limits, fail, resize_to, resample)


def plan_video(
    source: str | Path | bytes | bytearray | memoryview | np.ndarray,
    limits: MediaLimits = DEFAULT_LIMITS,
    *,
    item: str = "video",
    param: str | None = None,
    array_fps: float | None = None,
) -> VideoPlan:
    """The `VideoPlan` `load_video` follows for `source`, from the container's headers: stream size, frame
    rate and duration (packet timestamps when the headers lack it), the display rotation from an mp4 /
    mov's track matrices. Only where those cannot tell the upright frame size (other containers, a
    rotated or unusual matrix, no size in the header) is the first frame decoded, and never converted.
    Every check of `load_video` that needs no pixels applies, with the same messages."""

    def fail(message: str) -> InvalidRequestError:
        return InvalidRequestError(f"{item}: {message}", param=param)

    if isinstance(source, np.ndarray):
        video = _video_from_array(source, limits, array_fps, fail)
        t, h, w, _ = video.frames.shape
        return VideoPlan(w, h, t, video.fps, video.source_fps, video.duration_s, video.timestamps_s)
    source_ = _open_video_source(source, limits, fail)
    container = _open_container(source_, fail)
    with container:
        header = _read_header(container, source_, limits, fail)
        targets, step = _sample_times(header, limits)
        width, height, quarter_turns = header.width, header.height, 0
        unrotated = source_.demuxer == "avi" or (source_.demuxer == "mov" and _mov_is_unrotated(source_.raw))
        if width < 1 or height < 1 or not unrotated:
            frame = _first_frame(container, header.stream, fail)
            _check_frame_size(frame.width, frame.height, limits, fail)
            quarter_turns = _quarter_turns(frame)
            if width < 1 or height < 1:
                width, height = frame.width, frame.height
    if quarter_turns % 2:
        width, height = height, width
    return VideoPlan(
        width=width,
        height=height,
        num_frames=len(targets),
        fps=1.0 / step,
        source_fps=header.source_fps if header.source_fps > 0 else 1.0 / step,
        duration_s=header.duration,
    )


def check_resize(resize_to: tuple[int, int] | None, resample: int) -> None:
    """Raise ValueError unless `resize_to` is None or (height, width) > 0 and `resample` a PIL filter id:
    programming errors, not user input (the caller computes both from the plan and the checkpoint)."""
    if resize_to is not None and (
        not isinstance(resize_to, (tuple, list))
        or len(resize_to) != 2
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in resize_to)
    ):
        raise ValueError(f"resize_to must be (height, width) positive ints, got {resize_to!r}")
    if isinstance(resample, bool) or resample not in _PIL_FILTERS:
        raise ValueError(f"resample must be a PIL filter id {sorted(_PIL_FILTERS)}, got {resample!r}")


def _resize(rgb: np.ndarray, resize_to: tuple[int, int], resample: int) -> np.ndarray:
    """[H, W, 3] -> [h, w, 3] uint8, exactly as preprocess.py resizes a frame (PIL, in uint8)."""
    h, w = resize_to
    if rgb.shape[:2] == (h, w):
        return rgb
    return np.asarray(Image.fromarray(rgb).resize((w, h), resample=resample))


def _video_from_array(
    frames: np.ndarray, limits: MediaLimits, fps: float | None, fail: Callable[[str], InvalidRequestError]
) -> DecodedVideo:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise fail(f"an array video must be uint8 [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    t, h, w, _ = frames.shape
    if t < 1 or h < 1 or w < 1:
        raise fail(f"has no frames or an empty frame size (shape {list(frames.shape)})")
    if t > limits.max_video_frames:
        raise fail(f"has {t} frames; at most {limits.max_video_frames} are allowed (max_video_frames)")
    if h * w > limits.max_video_pixels_per_frame:
        raise fail(
            f"frames of {w}x{h} = {w * h} pixels exceed the limit of {limits.max_video_pixels_per_frame} "
            "(max_video_pixels_per_frame)"
        )
    fps = limits.video_fps if fps is None else fps
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not (fps > 0 and math.isfinite(fps)):
        raise fail(f"fps must be a positive number, got {fps!r}")
    if t / fps > limits.max_video_duration_s:
        raise fail(
            f"lasts {t / fps:.1f} s; at most {limits.max_video_duration_s:g} s are allowed (max_video_duration_s)"
        )
    return DecodedVideo(
        frames=np.ascontiguousarray(frames),
        fps=float(fps),
        source_fps=float(fps),
        duration_s=t / fps,
        timestamps_s=tuple(k / fps for k in range(t)),
    )


@dataclass(frozen=True)
class _VideoSource:
    """A checked encoded video: how to open it with PyAV, and as raw bytes (for the box reader)."""

    container: Callable[[], av.container.InputContainer]
    raw: Callable[[], BinaryIO]
    demuxer: str


def _open_video_source(
    source: str | Path | bytes | bytearray | memoryview,
    limits: MediaLimits,
    fail: Callable[[str], InvalidRequestError],
) -> _VideoSource:
    """The byte cap and format sniffing of `load_video` / `plan_video`: nothing is demuxed yet."""
    if isinstance(source, (str, Path)) and not _is_data_url(source):
        path = _check_path(source, limits.max_video_bytes, "max_video_bytes", "video", fail)
        try:
            with open(path, "rb") as f:
                head = f.read(16)
        except OSError as exc:
            raise fail("could not be read") from exc
        demuxer = _sniff_video_format(head, fail)
        # An absolute path: FFmpeg never reads a "scheme:" prefix of it as a protocol (concat:, http:...).
        url = str(path.resolve())
        return _VideoSource(
            lambda: av.open(url, format=demuxer, metadata_errors="ignore"), lambda: open(url, "rb"), demuxer
        )
    data = _read_source(source, limits.max_video_bytes, "max_video_bytes", "video", fail)
    demuxer = _sniff_video_format(data[:16], fail)
    return _VideoSource(
        lambda: av.open(io.BytesIO(data), format=demuxer, metadata_errors="ignore"),
        lambda: io.BytesIO(data),
        demuxer,
    )


def _sniff_video_format(head: bytes, fail: Callable[[str], InvalidRequestError]) -> str:
    """Pick the demuxer from magic bytes. Forcing it keeps FFmpeg's playlist demuxers (HLS, concat),
    which open other files or URLs, away from user bytes."""
    if head[:4] == _EBML_MAGIC:
        return "matroska"  # also reads WebM
    if head[4:8] in _BMFF_BOXES:
        return "mov"  # FFmpeg's mov demuxer reads mp4, mov, m4v, 3gp
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    raise fail("is not a supported video format (supported: mp4, mov, mkv, webm, avi)")


@dataclass(frozen=True)
class _Header:
    """The first video stream's header, every limit that needs no pixels already checked."""

    stream: av.VideoStream
    width: int  # coded size, before display rotation; 0 when the header does not say
    height: int
    source_fps: float  # 0.0 when the header does not say
    duration: float  # seconds, of the whole clip


def _open_container(
    source: _VideoSource, fail: Callable[[str], InvalidRequestError]
) -> av.container.InputContainer:
    try:
        return source.container()
    except MemoryError:
        raise
    except Exception as exc:  # av.error.InvalidDataError and friends: never echoed
        raise fail("could not be decoded (corrupt, truncated or unsupported video data)") from exc


def _read_header(
    container: av.container.InputContainer,
    source: _VideoSource,
    limits: MediaLimits,
    fail: Callable[[str], InvalidRequestError],
) -> _Header:
    if not container.streams.video:
        raise fail("has no video stream")
    try:  # a damaged header can leave a stream without a decoder (codec_context None) or rates
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        source_fps = float(stream.average_rate or stream.guessed_rate or 0.0)
        duration = _stream_duration(stream, container)
    except MemoryError:
        raise
    except Exception as exc:
        raise fail("could not be decoded (corrupt, truncated or unsupported video data)") from exc
    _check_frame_size(width, height, limits, fail)
    if duration is None:  # not in the headers: read the packet timestamps once (no decoding)
        duration = _scan_duration(source.container, fail)
    if duration > limits.max_video_duration_s:
        raise fail(
            f"lasts {duration:.1f} s; at most {limits.max_video_duration_s:g} s are allowed "
            "(max_video_duration_s)"
        )
    return _Header(stream, max(0, width or 0), max(0, height or 0), source_fps, duration)


def _sample_times(header: _Header, limits: MediaLimits) -> tuple[list[float], float]:
    """-> (target times in seconds from the first frame, their spacing). Every k / video_fps that falls
    before the last frame's midpoint, unless that exceeds max_video_frames or the source's own frame count;
    then that many times spread evenly over the clip. From the header only: `plan_video` shares it."""
    duration, source_fps = header.duration, header.source_fps
    tol = _tolerance(source_fps)
    num = max(1, math.ceil((duration - tol) * limits.video_fps))
    step = 1.0 / limits.video_fps
    cap = limits.max_video_frames
    if source_fps > 0:
        cap = min(cap, max(1, round(duration * source_fps)))  # never sample faster than the source
    if num > cap:
        num, step = cap, duration / cap
    return [k * step for k in range(num)], step


def _tolerance(source_fps: float) -> float:
    return 0.5 / source_fps if source_fps > 0 else 1e-3


def _decode_video(
    source: _VideoSource,
    limits: MediaLimits,
    fail: Callable[[str], InvalidRequestError],
    resize_to: tuple[int, int] | None = None,
    resample: int = 3,
) -> DecodedVideo:
    container = _open_container(source, fail)
    with container:
        header = _read_header(container, source, limits, fail)
        header.stream.thread_type = "AUTO"
        targets, step = _sample_times(header, limits)
        frames, times = _decode_selected(container, header, targets, limits, fail, resize_to, resample)
    source_fps = header.source_fps
    return DecodedVideo(
        frames=frames,
        fps=1.0 / step,
        source_fps=source_fps if source_fps > 0 else 1.0 / step,
        duration_s=header.duration,
        timestamps_s=tuple(times),
    )


def _decode_frames(container: av.container.InputContainer, stream: av.VideoStream) -> Iterator[av.VideoFrame]:
    """Every decoded frame of `stream`, in order. The one place frames are decoded (tests count them)."""
    return container.decode(stream)


def _first_frame(
    container: av.container.InputContainer, stream: av.VideoStream, fail: Callable[[str], InvalidRequestError]
) -> av.VideoFrame:
    """Decode (never convert) frames up to the first: its size and display rotation."""
    try:
        for frame in _decode_frames(container, stream):
            return frame
    except MemoryError:
        raise
    except Exception as exc:
        raise fail("could not be decoded (corrupt or truncated video data)") from exc
    raise fail("has no decodable frames")


def _decode_selected(
    container: av.container.InputContainer,
    header: _Header,
    targets: list[float],
    limits: MediaLimits,
    fail: Callable[[str], InvalidRequestError],
    resize_to: tuple[int, int] | None,
    resample: int,
) -> tuple[np.ndarray, list[float]]:
    """Decode in order, keeping for each target time the first frame at or after `target - tol` (the
    nearest frame; a tie goes to the earlier one). Targets past the last frame (a header that overstates
    the duration) get the last frame, so the count is always `len(targets)`, as `plan_video` says.

    Each kept frame is converted, rotated and resized on its own, then stored into one array allocated at
    the output size: decode -> RGB -> resize -> store, never a stack of full-size frames."""
    out: np.ndarray | None = None  # [T, H, W, 3] uint8, allocated at the first kept frame
    times: list[float] = []  # seconds from the first decoded frame
    tol = _tolerance(header.source_fps)
    max_decoded = int(max(header.duration, limits.max_video_duration_s) * _MAX_DECODED_FPS) + 1
    first_time: float | None = None
    # Coded (width, height) every kept frame is converted at: the header's, else the first frame's (one
    # array needs one frame size, and a stream may change resolution midway).
    coded = (header.width, header.height) if header.width > 0 and header.height > 0 else None
    fallback_fps = float(header.stream.average_rate or 0.0) or limits.video_fps
    try:
        for index, frame in enumerate(_decode_frames(container, header.stream)):
            if index >= max_decoded:
                raise fail("has too many frames for its duration")
            _check_frame_size(frame.width, frame.height, limits, fail)
            t = frame.time if frame.time is not None else index / fallback_fps
            if first_time is None:
                first_time = t
            rel = t - first_time
            if rel > limits.max_video_duration_s + 1.0:  # the header understated the duration
                raise fail(f"lasts more than {limits.max_video_duration_s:g} s (max_video_duration_s)")
            if rel < targets[len(times)] - tol:
                continue
            if coded is None:
                coded = (frame.width, frame.height)
            rgb = _frame_to_rgb(frame, coded)  # [H, W, 3], upright
            if resize_to is not None:
                rgb = _resize(rgb, resize_to, resample)
            if out is None:
                out = np.empty((len(targets), *rgb.shape), np.uint8)
            elif rgb.shape != out.shape[1:]:  # a rotation change midway: keep one frame size
                rgb = _resize(rgb, out.shape[1:3], resample)
            while len(times) < len(targets) and rel >= targets[len(times)] - tol:
                out[len(times)] = rgb  # a gap in a variable-rate clip may cover several targets
                times.append(rel)
            if len(times) == len(targets):
                break  # the tail is not needed
    except (InvalidRequestError, MemoryError):
        raise
    except Exception as exc:
        raise fail("could not be decoded (corrupt or truncated video data)") from exc
    if out is None:
        raise fail("has no decodable frames")
    for k in range(len(times), len(targets)):  # the stream ended early: hold its last frame
        out[k] = out[k - 1]
        times.append(times[-1])
    return out, times


def _quarter_turns(frame: av.VideoFrame) -> int:
    """Counter-clockwise quarter turns of the frame's display matrix (0 unless a multiple of 90)."""
    rotation = frame.rotation % 360 if frame.rotation else 0
    return rotation // 90 if rotation % 90 == 0 else 0


def _frame_to_rgb(frame: av.VideoFrame, coded: tuple[int, int]) -> np.ndarray:
    """[H, W, 3] uint8 RGB at the coded (width, height) `coded` (rescaled if the stream's resolution changed
    midway), then turned upright by the display matrix."""
    if (frame.width, frame.height) != coded:
        rgb = frame.to_ndarray(format="rgb24", width=coded[0], height=coded[1])
    else:
        rgb = frame.to_ndarray(format="rgb24")
    if quarter_turns := _quarter_turns(frame):
        rgb = np.ascontiguousarray(np.rot90(rgb, k=quarter_turns))
    return rgb


def _check_frame_size(
    w: int, h: int, limits: MediaLimits, fail: Callable[[str], InvalidRequestError]
) -> None:
    if w * h > limits.max_video_pixels_per_frame:
        raise fail(
            f"frames of {w}x{h} = {w * h} pixels exceed the limit of {limits.max_video_pixels_per_frame} "
            "(max_video_pixels_per_frame)"
        )


def _stream_duration(stream: av.VideoStream, container: av.container.InputContainer) -> float | None:
    if stream.duration is not None and stream.time_base is not None and stream.duration > 0:
        return float(stream.duration * stream.time_base)
    if container.duration is not None and container.duration > 0:  # in AV_TIME_BASE (microseconds)
        return container.duration / 1_000_000
    return None


def _scan_duration(
    open_container: Callable[[], av.container.InputContainer], fail: Callable[[str], InvalidRequestError]
) -> float:
    start, end = math.inf, -math.inf
    try:
        with open_container() as container:
            stream = container.streams.video[0]
            for packet in container.demux(stream):
                if packet.pts is None or packet.time_base is None:
                    continue
                t = float(packet.pts * packet.time_base)
                start = min(start, t)
                end = max(end, t + float((packet.duration or 0) * packet.time_base))
    except MemoryError:
        raise
    except Exception as exc:
        raise fail("could not be decoded (corrupt or truncated video data)") from exc
    if end < start:
        raise fail("has no frames")
    return max(end - start, 1e-3)


def _mov_is_unrotated(open_raw: Callable[[], BinaryIO]) -> bool:
    """True when an ISO-BMFF file's movie (mvhd) and every track (tkhd) matrix is a plain positive scale:
    FFmpeg then exports no rotation. False whenever unsure (no moov found, odd boxes, a huge moov): the
    caller then decodes the first frame instead. Reads box headers and the moov box only."""
    try:
        with open_raw() as f:
            moov = _find_box(f, b"moov")
        if moov is None:
            return False
        matrices = 0
        for kind, body in _boxes(moov):
            if kind == b"mvhd":
                if not _unrotated_matrix(body, 36, 48):
                    return False
            elif kind == b"trak":
                tkhd = next((b for k, b in _boxes(body) if k == b"tkhd"), None)
                if tkhd is None or not _unrotated_matrix(tkhd, 40, 52):
                    return False
                matrices += 1
        return matrices > 0
    except (OSError, ValueError, struct.error):
        return False


def _find_box(f: BinaryIO, kind: bytes) -> bytes | None:
    """The payload of the first top-level box `kind`, or None (not found, or larger than we read)."""
    f.seek(0, os.SEEK_END)
    end = f.tell()
    offset = 0
    for _ in range(_MAX_TOP_BOXES):
        if offset + 8 > end:
            return None
        f.seek(offset)
        size, box = struct.unpack(">I4s", f.read(8))
        head = 8
        if size == 1:
            (size,) = struct.unpack(">Q", f.read(8))
            head = 16
        elif size == 0:
            size = end - offset
        if size < head:
            return None
        if box == kind:
            if size - head > _MAX_MOOV_BYTES:
                return None
            body = f.read(size - head)
            return body if len(body) == size - head else None
        offset += size
    return None


def _boxes(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(type, payload) of the boxes in `data`; stops at the first malformed one."""
    offset = 0
    while offset + 8 <= len(data):
        size, kind = struct.unpack_from(">I4s", data, offset)
        head = 8
        if size == 1 and offset + 16 <= len(data):
            (size,) = struct.unpack_from(">Q", data, offset + 8)
            head = 16
        elif size == 0:
            size = len(data) - offset
        if size < head or offset + size > len(data):
            return
        yield kind, data[offset + head : offset + size]
        offset += size


def _unrotated_matrix(body: bytes, offset_v0: int, offset_v1: int) -> bool:
    """The 3x3 16.16 matrix of an mvhd / tkhd full box (its offset depends on the version) is
    [[a, b, _], [c, d, _], ...] with a, d > 0 and b = c = 0: a scale, no rotation or mirror."""
    offset = offset_v1 if body[:1] == b"\x01" else offset_v0
    a, b, _, c, d = struct.unpack_from(">5i", body, offset)
    return a > 0 and d > 0 and b == 0 and c == 0


# ------------------------------------------------------------------------------------- shared helpers


def encoded_source(
    source: bytes | bytearray | memoryview | str | Path,
    kind: str,
    limits: MediaLimits = DEFAULT_LIMITS,
    *,
    item: str,
    param: str | None = None,
) -> bytes | Path:
    """The cheap checks of `load_image` / `load_video`, run before any decoder: bytes or a data URL ->
    the encoded bytes under the byte cap; a local path -> the absolute path (decode workers run in
    another directory), its size under the cap. A video's
    container must also be one we demux (magic bytes). Raises `InvalidRequestError` naming `item`."""

    def fail(message: str) -> InvalidRequestError:
        return InvalidRequestError(f"{item}: {message}", param=param)

    max_bytes, limit_name = (
        (limits.max_image_bytes, "max_image_bytes")
        if kind == "image"
        else (limits.max_video_bytes, "max_video_bytes")
    )
    if isinstance(source, (str, Path)) and not _is_data_url(source):
        path = _check_path(source, max_bytes, limit_name, kind, fail)
        if kind == "video":
            try:
                with open(path, "rb") as f:
                    head = f.read(16)
            except OSError as exc:
                raise fail("could not be read") from exc
            _sniff_video_format(head, fail)
        return path.resolve()
    data = _read_source(source, max_bytes, limit_name, kind, fail)
    if kind == "video":
        _sniff_video_format(data[:16], fail)
    return data


def _is_data_url(source: str | Path) -> bool:
    return isinstance(source, str) and source[:5].lower() == "data:"


def _read_source(
    source: bytes | bytearray | memoryview | str | Path,
    max_bytes: int,
    limit_name: str,
    kind: str,
    fail: Callable[[str], InvalidRequestError],
) -> bytes:
    """Encoded bytes of a bytes / data URL / path source, refusing more than `max_bytes`."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif _is_data_url(source):
        data = _decode_data_url(str(source), max_bytes, limit_name, fail)
    elif isinstance(source, (str, Path)):
        path = _check_path(source, max_bytes, limit_name, kind, fail)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise fail("could not be read") from exc
    else:
        raise fail(f"must be bytes, a data URL or a local path, got {type(source).__name__}")
    if len(data) > max_bytes:
        raise fail(f"is {len(data)} bytes; at most {max_bytes} are allowed ({limit_name})")
    if not data:
        raise fail("is empty")
    return data


def _check_path(
    source: str | Path, max_bytes: int, limit_name: str, kind: str, fail: Callable[[str], InvalidRequestError]
) -> Path:
    text = str(source)
    if "://" in text[:16]:
        raise fail(f"must be a data URL or a local path; remote {kind} URLs are not fetched here")
    path = Path(text)
    try:
        size = os.stat(path).st_size
    except (OSError, ValueError) as exc:  # ValueError: NUL in the path
        raise fail("file not found or not readable") from exc
    if not path.is_file():
        raise fail("is not a regular file")
    if size > max_bytes:
        raise fail(f"is {size} bytes; at most {max_bytes} are allowed ({limit_name})")
    return path


def _decode_data_url(
    url: str, max_bytes: int, limit_name: str, fail: Callable[[str], InvalidRequestError]
) -> bytes:
    """`data:[<mediatype>][;base64],<data>`; the media type is not trusted (content decides the format)."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise fail("is a malformed data URL (no ',')")
    if header.lower().endswith(";base64"):
        # 4 base64 characters carry 3 bytes: refuse oversized payloads before decoding them.
        if (len(payload) // 4) * 3 > max_bytes + 3:
            raise fail(f"is more than {max_bytes} bytes ({limit_name})")
        try:
            return base64.b64decode(payload.strip(), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise fail("is a data URL with invalid base64") from exc
    if len(payload) > 3 * max_bytes + 3:  # percent-encoding: at most 3 characters per byte
        raise fail(f"is more than {max_bytes} bytes ({limit_name})")
    return urllib.parse.unquote_to_bytes(payload)
