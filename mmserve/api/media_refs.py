"""Resolves chat media references for the engine: file ids -> stored blob paths, data URLs as they are,
local paths under `--allowed-local-media-path` only, http(s) only for `--allowed-media-domains`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmserve.api.errors import APIError
from mmserve.api.media_store import MediaStore, is_file_id
from mmserve.api.protocol import ChatMessage, FilePart, ImageURLPart, TextPart, VideoURLPart
from mmserve.api.remote_media import RemoteFetcher
from mmserve.api.settings import ServerSettings


class MediaResolver:
    def __init__(self, store: MediaStore, settings: ServerSettings) -> None:
        self.store = store
        self.local_root = (
            settings.allowed_local_media_path.resolve() if settings.allowed_local_media_path else None
        )
        self.remote = RemoteFetcher(
            settings.allowed_media_domains,
            timeout_s=settings.remote_media_timeout_s,
            allow_private=settings.allow_private_media_addresses,
        )

    async def resolve(self, messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """Returns the engine messages and the number of media items per kind (for metrics)."""
        counts = {"image": 0, "video": 0}
        out: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            if message.content is None or isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content or ""})
                continue
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(message.content):
                param = f"messages.{i}.content.{j}"
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": part.text})
                    continue
                kind, source = await self._part(part, param)
                counts[kind] += 1
                parts.append({"type": kind, kind: source})
            out.append({"role": message.role, "content": parts})
        return out, counts

    async def _part(self, part: ImageURLPart | VideoURLPart | FilePart, param: str) -> tuple[str, object]:
        if isinstance(part, FilePart):
            obj = self._file(part.file.file_id, param)
            return obj.media_type, self.store.blob_path(obj)
        kind = "image" if isinstance(part, ImageURLPart) else "video"
        url = (part.image_url if isinstance(part, ImageURLPart) else part.video_url).url.strip()
        if url[:5].lower() == "data:":
            return kind, url
        if is_file_id(url) or url.startswith("file-"):
            obj = self._file(url, param)
            if obj.media_type != kind:
                raise APIError(400, f"{param}: file {url} is a {obj.media_type}, not a {kind}",
                               code="invalid_media_reference", param=param)  # fmt: skip
            return kind, self.store.blob_path(obj)
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme in ("http", "https"):
            if not self.remote.allows(url):
                raise APIError(
                    400, f"{param}: remote media URLs are refused for this host (see --allowed-media-domains); "
                    "upload the file to /v1/files or send a data URL", code="remote_media_disabled", param=param,
                )  # fmt: skip
            limits = self.store.limits
            max_bytes = limits.max_image_bytes if kind == "image" else limits.max_video_bytes
            return kind, await self.remote.fetch(url, max_bytes, param)
        if scheme:
            raise APIError(400, f"{param}: unsupported URL scheme {scheme!r}", code="invalid_media_reference",
                           param=param)  # fmt: skip
        return kind, self._local(url, param)

    def _file(self, file_id: str, param: str) -> Any:
        obj = self.store.get(file_id)
        if obj is None:
            raise APIError(400, f"{param}: no uploaded file with id {file_id!r}", code="file_not_found",
                           param=param)  # fmt: skip
        return obj

    def _local(self, url: str, param: str) -> Path:
        if self.local_root is None:
            raise APIError(
                400, f"{param}: local file paths are not allowed (start the server with "
                "--allowed-local-media-path DIR)", code="local_media_disabled", param=param,
            )  # fmt: skip
        path = Path(url.removeprefix("file://"))
        resolved = (self.local_root / path).resolve()  # an absolute `path` replaces the root
        if not resolved.is_relative_to(self.local_root):
            raise APIError(400, f"{param}: the path is outside the allowed media directory",
                           code="local_media_disabled", param=param)  # fmt: skip
        return resolved
