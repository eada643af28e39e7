"""`client.files`: upload (multipart), list, retrieve, delete and download image/video files.

The server decides the media type from the content; the filename sent is metadata only.
"""

from __future__ import annotations

import mimetypes
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from mmserve.client._base import NOT_GIVEN, AsyncTransport, SyncTransport, TimeoutTypes, parse_json
from mmserve.client.types import FileDeleted, FileList, FileObject

# A path, raw bytes, `(filename, bytes)` or an open binary file.
FileInput = str | os.PathLike[str] | bytes | tuple[str, bytes] | IO[bytes]


def _multipart(file: FileInput, stack: list[IO[bytes]]) -> Callable[[], Mapping[str, Any]]:
    """A per-attempt builder of the `files=` value (a retry re-reads an open file from its start)."""
    if isinstance(file, bytes):
        name, payload = "upload", file
        return lambda: {"file": (name, payload, "application/octet-stream")}
    if isinstance(file, tuple):
        name, payload = file
        return lambda: {"file": (name, payload, _guess_type(name))}
    if isinstance(file, (str, os.PathLike)):
        path = Path(file)
        handle: IO[bytes] = path.open("rb")  # raises FileNotFoundError before any request
        stack.append(handle)
        name = path.name
    else:
        handle, name = file, Path(getattr(file, "name", "upload")).name

    def build() -> Mapping[str, Any]:
        handle.seek(0)
        return {"file": (name, handle, _guess_type(name))}

    return build


def _guess_type(name: str) -> str:
    return mimetypes.guess_type(name)[0] or "application/octet-stream"


class Files:
    def __init__(self, transport: SyncTransport) -> None:
        self._transport = transport

    def create(
        self, *, file: FileInput, purpose: str | None = None, timeout: TimeoutTypes = NOT_GIVEN
    ) -> FileObject:
        """POST /v1/files: upload an image or video; the returned `id` can be used as a media url."""
        opened: list[IO[bytes]] = []
        try:
            files = _multipart(file, opened)
            data = {"purpose": purpose} if purpose is not None else None
            response = self._transport.request("POST", "/v1/files", files=files, data=data, timeout=timeout)
        finally:
            for handle in opened:
                handle.close()
        return FileObject.model_validate(parse_json(response))

    def retrieve(self, file_id: str) -> FileObject:
        return FileObject.model_validate(parse_json(self._transport.request("GET", f"/v1/files/{file_id}")))

    def list(self) -> FileList:
        return FileList.model_validate(parse_json(self._transport.request("GET", "/v1/files")))

    def delete(self, file_id: str) -> FileDeleted:
        return FileDeleted.model_validate(
            parse_json(self._transport.request("DELETE", f"/v1/files/{file_id}"))
        )

    def content(self, file_id: str) -> bytes:
        """The stored bytes, exactly as uploaded."""
        return self._transport.request("GET", f"/v1/files/{file_id}/content").content


class AsyncFiles:
    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def create(
        self, *, file: FileInput, purpose: str | None = None, timeout: TimeoutTypes = NOT_GIVEN
    ) -> FileObject:
        opened: list[IO[bytes]] = []
        try:
            files = _multipart(file, opened)
            data = {"purpose": purpose} if purpose is not None else None
            response = await self._transport.request(
                "POST", "/v1/files", files=files, data=data, timeout=timeout
            )
        finally:
            for handle in opened:
                handle.close()
        return FileObject.model_validate(parse_json(response))

    async def retrieve(self, file_id: str) -> FileObject:
        response = await self._transport.request("GET", f"/v1/files/{file_id}")
        return FileObject.model_validate(parse_json(response))

    async def list(self) -> FileList:
        return FileList.model_validate(parse_json(await self._transport.request("GET", "/v1/files")))

    async def delete(self, file_id: str) -> FileDeleted:
        response = await self._transport.request("DELETE", f"/v1/files/{file_id}")
        return FileDeleted.model_validate(parse_json(response))

    async def content(self, file_id: str) -> bytes:
        return (await self._transport.request("GET", f"/v1/files/{file_id}/content")).content
