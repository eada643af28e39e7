"""Content-part helpers: `image_part` (inlined as a data URL) and `video_part` (uploaded, referenced by id).

Images are small enough to inline; a video path is uploaded through `client.files` so the chat request
stays small. The MIME type of an inline image comes from its magic bytes, never from a filename.
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmserve.client.client import AsyncClient, Client

_IMAGE_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
)
# A video this small may be inlined as a data URL when no client is given to upload it.
MAX_INLINE_VIDEO_BYTES = 4 * 2**20


def sniff_image_type(data: bytes) -> str:
    """MIME type from the leading bytes; ValueError if it is not a recognised image format."""
    for magic, mime in _IMAGE_MAGIC:
        if data.startswith(magic):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    raise ValueError("not a PNG, JPEG, GIF, BMP or WebP image")


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def image_part(image: str | os.PathLike[str] | bytes | Any) -> dict[str, Any]:
    """`{"type": "image_url", "image_url": {"url": <data URL>}}` from a path, bytes or a `PIL.Image`."""
    if isinstance(image, (str, os.PathLike)):
        data = Path(image).read_bytes()
    elif isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    elif hasattr(image, "save") and hasattr(image, "mode"):  # a PIL.Image, without importing Pillow here
        buf = io.BytesIO()
        img = image if image.mode in ("RGB", "RGBA", "L", "LA", "P") else image.convert("RGB")
        img.save(buf, format="PNG")  # lossless, so the server sees the caller's exact pixels
        data = buf.getvalue()
    else:
        raise TypeError(f"image_part expects a path, bytes or PIL.Image, got {type(image).__name__}")
    return {"type": "image_url", "image_url": {"url": data_url(data, sniff_image_type(data))}}


def _video_ref(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def _is_path(video: str | os.PathLike[str]) -> bool:
    return isinstance(video, os.PathLike) or os.path.exists(video) or os.sep in video or "." in video


def video_part(
    video: str | os.PathLike[str], client: Client | None = None, *, purpose: str | None = None
) -> dict[str, Any]:
    """`{"type": "video_url", "video_url": {"url": file_id}}` from a path (uploaded via `client`) or a file id.

    A string that is an existing path (or looks like one) is a path; anything else is a file id, used as is.
    Without a client, a path is inlined as a data URL if it is at most MAX_INLINE_VIDEO_BYTES.
    """
    if isinstance(video, str) and video.startswith("data:"):
        return _video_ref(video)
    if not _is_path(video):
        return _video_ref(str(video))
    path = Path(video)
    if client is not None:
        return _video_ref(client.files.create(file=path, purpose=purpose).id)
    return _video_ref(_inline_video(path))


async def avideo_part(
    video: str | os.PathLike[str], client: AsyncClient | None = None, *, purpose: str | None = None
) -> dict[str, Any]:
    """`video_part` for an `AsyncClient` (the upload is awaited)."""
    if isinstance(video, str) and video.startswith("data:"):
        return _video_ref(video)
    if not _is_path(video):
        return _video_ref(str(video))
    path = Path(video)
    if client is not None:
        return _video_ref((await client.files.create(file=path, purpose=purpose)).id)
    return _video_ref(_inline_video(path))


def _inline_video(path: Path) -> str:
    size = path.stat().st_size  # FileNotFoundError for a missing path
    if size > MAX_INLINE_VIDEO_BYTES:
        raise ValueError(
            f"{path} is {size} bytes; pass client= so it is uploaded (inline limit {MAX_INLINE_VIDEO_BYTES})"
        )
    return data_url(path.read_bytes(), "video/mp4" if path.suffix.lower() != ".webm" else "video/webm")
