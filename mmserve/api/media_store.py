"""Uploaded images and videos: kind by content, validation by decoding, `blobs/<sha256>` + `files/<id>.json`
under the data dir. Client filenames are metadata only and never touch a path; knows nothing of HTTP."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Literal

from mmserve.api.errors import APIError
from mmserve.api.protocol import FileObject
from mmserve.encoders.decode_pool import DecodePool
from mmserve.encoders.media import MediaLimits

_ID = re.compile(r"^file-[0-9a-f]{24}$")
_BMFF_BOXES = {b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot", b"uuid"}

MediaKind = Literal["image", "video"]


def sniff_kind(head: bytes) -> MediaKind | None:
    """Image or video from the first 16 bytes (magic numbers), or None. The full check is a real decode."""
    if head[:3] == b"\xff\xd8\xff" or head[:8] == b"\x89PNG\r\n\x1a\n" or head[:4] in (b"GIF8",):
        return "image"
    if head[:2] == b"BM" or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
        return "image"
    if (
        head[4:8] in _BMFF_BOXES
        or head[:4] == b"\x1a\x45\xdf\xa3"
        or (head[:4] == b"RIFF" and head[8:12] == b"AVI ")
    ):
        return "video"
    return None


def is_file_id(text: str) -> bool:
    return bool(_ID.match(text))


class MediaStore:
    def __init__(
        self,
        data_dir: Path,
        limits: MediaLimits,
        max_image_bytes: int,
        max_video_bytes: int,
        decoder: DecodePool | None = None,
    ) -> None:
        """`decoder`: the worker pool that validates uploads (default: a pool of its own, sized by `limits`)."""
        self.root = Path(data_dir)
        self.blobs, self.files, self.tmp = self.root / "blobs", self.root / "files", self.root / "tmp"
        # Private to the server's user: uploads are other people's images (0700 dirs, 0600 files).
        for d in (self.root, self.blobs, self.files, self.tmp):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)  # mkdir's mode is masked by the umask, and an existing dir keeps its own
        self.max_bytes = {"image": max_image_bytes, "video": max_video_bytes}
        self.limits = replace(limits, max_image_bytes=max_image_bytes, max_video_bytes=max_video_bytes)
        self.decoder = decoder or DecodePool.for_limits(limits)

    async def save(self, chunks: AsyncIterator[bytes], filename: str, purpose: str) -> FileObject:
        """Stream an upload to disk (refusing it with 413 once over its kind's cap), validate it by
        decoding, and file it under its sha256. Raises APIError (400/413/415) or InvalidRequestError."""
        tmp = self.tmp / secrets.token_hex(16)
        digest, size, kind = hashlib.sha256(), 0, None
        head = b""
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
                async for chunk in chunks:
                    if kind is None:
                        head += chunk
                        if len(head) < 16:
                            continue
                        kind = self._kind(head)
                        chunk, head = head, b""
                    size += len(chunk)
                    if size > self.max_bytes[kind]:
                        raise APIError(
                            413, f"file: {kind} uploads are limited to {self.max_bytes[kind]} bytes",
                            code=f"{kind}_too_large", param="file",
                        )  # fmt: skip
                    digest.update(chunk)
                    out.write(chunk)
                if kind is None:  # fewer than 16 bytes in all
                    if not head:
                        raise APIError(400, "file: is empty", code="empty_file", param="file")
                    kind = self._kind(head)
                    size += len(head)
                    digest.update(head)
                    out.write(head)
            info = await asyncio.to_thread(self._probe, tmp, kind)
            sha = digest.hexdigest()
            blob = self.blobs / sha
            if blob.exists():
                tmp.unlink()
            else:
                os.replace(tmp, blob)
        finally:
            tmp.unlink(missing_ok=True)
        obj = FileObject(
            id="file-" + secrets.token_hex(12), bytes=size, created_at=int(time.time()),
            filename=_clean_name(filename), purpose=purpose, media_type=kind, sha256=sha, **info,
        )  # fmt: skip
        self._write_meta(obj)
        return obj

    def get(self, file_id: str) -> FileObject | None:
        if not is_file_id(file_id):
            return None
        try:
            return FileObject.model_validate_json((self.files / f"{file_id}.json").read_text())
        except FileNotFoundError:
            return None

    def require(self, file_id: str) -> FileObject:
        obj = self.get(file_id)
        if obj is None:
            raise APIError(404, f"no file with id {file_id!r}", code="file_not_found", param="file_id")
        return obj

    def blob_path(self, obj: FileObject) -> Path:
        return self.blobs / obj.sha256

    def list(self) -> list[FileObject]:
        objs = [FileObject.model_validate_json(p.read_text()) for p in self.files.glob("file-*.json")]
        return sorted(objs, key=lambda o: (o.created_at, o.id))

    def delete(self, file_id: str) -> bool:
        obj = self.get(file_id)
        if obj is None:
            return False
        (self.files / f"{file_id}.json").unlink(missing_ok=True)
        if not any(o.sha256 == obj.sha256 for o in self.list()):  # last reference to the blob
            self.blob_path(obj).unlink(missing_ok=True)
        return True

    # -- internals ------------------------------------------------------------------------------------
    def _kind(self, head: bytes) -> MediaKind:
        kind = sniff_kind(head)
        if kind is None:
            raise APIError(
                415, "file: is not a supported image (jpeg, png, webp, gif, bmp) or video (mp4, mov, mkv, "
                "webm, avi)", code="unsupported_media_type", param="file",
            )  # fmt: skip
        return kind

    def _probe(self, path: Path, kind: MediaKind) -> dict[str, float | int]:
        """Decode enough to trust the file, in a decode worker: a whole image; a video's headers and first
        frame (every limit still checked). Blocks: run it off the event loop."""
        if kind == "image":
            image = self.decoder.probe_image(path, self.limits, item="file", param="file")
            return {"width": image.width, "height": image.height}
        video = self.decoder.probe_video(path, self.limits, item="file", param="file")
        return {
            "width": video.width, "height": video.height, "duration_s": round(video.duration_s, 3),
            "fps": round(video.source_fps, 3), "num_frames": max(1, round(video.duration_s * video.source_fps)),
        }  # fmt: skip

    def _write_meta(self, obj: FileObject) -> None:
        path = self.files / f"{obj.id}.json"
        tmp = path.with_suffix(".tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
            out.write(obj.model_dump_json())
        os.replace(tmp, path)


def _clean_name(name: str) -> str:
    """Metadata only: the last path component, printable, at most 255 characters."""
    name = name.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in name if c.isprintable())
    return name[:255] or "upload"
