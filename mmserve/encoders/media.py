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
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

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
) -> DecodedVideo:
    """Decode `source` (encoded bytes, data URL, local path, or a uint8 array) into sampled RGB frames.

    A `[T, H, W, 3]` uint8 array is used frame for frame (no resampling) at `array_fps` (default
    `limits.video_fps`). Files are decoded with PyAV and sampled uniformly in time at `limits.video_fps`,
    more sparsely when that would exceed `limits.max_video_frames`. Any failure raises
    `InvalidRequestError` naming `item`.
    """

    def fail(message: str) -> InvalidRequestError:
        return InvalidRequestError(f"{item}: {message}", param=param)

    if isinstance(source, np.ndarray):
        return _video_from_array(source, limits, array_fps, fail)
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
        return _decode_video(lambda: av.open(url, format=demuxer, metadata_errors="ignore"), limits, fail)
    data = _read_source(source, limits.max_video_bytes, "max_video_bytes", "video", fail)
    demuxer = _sniff_video_format(data[:16], fail)
    return _decode_video(
        lambda: av.open(io.BytesIO(data), format=demuxer, metadata_errors="ignore"), limits, fail
    )


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


def _decode_video(
    open_container: Callable[[], av.container.InputContainer],
    limits: MediaLimits,
    fail: Callable[[str], InvalidRequestError],
) -> DecodedVideo:
    try:
        container = open_container()
    except MemoryError:
        raise
    except Exception as exc:  # av.error.InvalidDataError and friends: never echoed
        raise fail("could not be decoded (corrupt, truncated or unsupported video data)") from exc
    with container:
        if not container.streams.video:
            raise fail("has no video stream")
        try:  # a damaged header can leave a stream without a decoder (codec_context None) or rates
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            width, height = stream.codec_context.width, stream.codec_context.height
            source_fps = float(stream.average_rate or stream.guessed_rate or 0.0)
            duration = _stream_duration(stream, container)
        except MemoryError:
            raise
        except Exception as exc:
            raise fail("could not be decoded (corrupt, truncated or unsupported video data)") from exc
        _check_frame_size(width, height, limits, fail)
        if duration is None:  # not in the headers: read the packet timestamps once (no decoding)
            duration = _scan_duration(open_container, fail)
        if duration > limits.max_video_duration_s:
            raise fail(
                f"lasts {duration:.1f} s; at most {limits.max_video_duration_s:g} s are allowed "
                "(max_video_duration_s)"
            )

        # Sampling plan, in seconds from the first frame: every k / video_fps that falls before the last
        # frame's midpoint, unless that exceeds max_video_frames or the source's own frame count; then that
        # many times spread evenly over the clip. A frame is picked for time t when it is the nearest one
        # (it starts at or after t - tol); a tie goes to the earlier frame.
        tol = 0.5 / source_fps if source_fps > 0 else 1e-3
        num = max(1, math.ceil((duration - tol) * limits.video_fps))
        step = 1.0 / limits.video_fps
        cap = limits.max_video_frames
        if source_fps > 0:
            cap = min(cap, max(1, round(duration * source_fps)))  # never sample faster than the source
        if num > cap:
            num, step = cap, duration / cap
        targets = [k * step for k in range(num)]
        frames, times = _decode_selected(container, stream, targets, tol, duration, limits, fail)
    if not frames:
        raise fail("has no decodable frames")
    return DecodedVideo(
        frames=np.stack(frames),
        fps=1.0 / step,
        source_fps=source_fps if source_fps > 0 else 1.0 / step,
        duration_s=duration,
        timestamps_s=tuple(times),
    )


def _decode_selected(
    container: av.container.InputContainer,
    stream: av.VideoStream,
    targets: list[float],
    tol: float,
    duration: float,
    limits: MediaLimits,
    fail: Callable[[str], InvalidRequestError],
) -> tuple[list[np.ndarray], list[float]]:
    """Decode in order, keeping for each target time the first frame at or after `target - tol`."""
    frames: list[np.ndarray] = []  # each [H, W, 3] uint8, all the size of the first kept frame
    times: list[float] = []  # seconds from the first decoded frame
    max_decoded = int(max(duration, limits.max_video_duration_s) * _MAX_DECODED_FPS) + 1
    first_time: float | None = None
    size: tuple[int, int] | None = None  # (width, height) of the kept frames, after rotation
    fallback_fps = float(stream.average_rate or 0.0) or limits.video_fps
    try:
        for index, frame in enumerate(container.decode(stream)):
            if index >= max_decoded:
                raise fail("has too many frames for its duration")
            _check_frame_size(frame.width, frame.height, limits, fail)
            t = frame.time if frame.time is not None else index / fallback_fps
            if first_time is None:
                first_time = t
            rel = t - first_time
            if rel > limits.max_video_duration_s + 1.0:  # the header understated the duration
                raise fail(f"lasts more than {limits.max_video_duration_s:g} s (max_video_duration_s)")
            if rel < targets[len(frames)] - tol:
                continue
            rgb = _frame_to_rgb(frame, size)
            size = (rgb.shape[1], rgb.shape[0])
            while len(frames) < len(targets) and rel >= targets[len(frames)] - tol:
                frames.append(rgb)  # a gap in a variable-rate clip may cover several targets
                times.append(rel)
            if len(frames) == len(targets):
                break  # the tail is not needed
    except (InvalidRequestError, MemoryError):
        raise
    except Exception as exc:
        raise fail("could not be decoded (corrupt or truncated video data)") from exc
    return frames, times


def _frame_to_rgb(frame: av.VideoFrame, size: tuple[int, int] | None) -> np.ndarray:
    """[H, W, 3] uint8 RGB, turned upright by the display matrix, rescaled to `size` if the stream's
    resolution changed midway (rare, but one array needs one frame size)."""
    rotation = frame.rotation % 360 if frame.rotation else 0  # counter-clockwise degrees
    quarter_turns = rotation // 90 if rotation % 90 == 0 else 0
    if size is not None:
        w, h = size if quarter_turns % 2 == 0 else (size[1], size[0])  # size before rotation
        if (frame.width, frame.height) != (w, h):
            rgb = frame.to_ndarray(format="rgb24", width=w, height=h)
        else:
            rgb = frame.to_ndarray(format="rgb24")
    else:
        rgb = frame.to_ndarray(format="rgb24")
    if quarter_turns:
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
