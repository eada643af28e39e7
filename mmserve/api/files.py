"""`/v1/files`: upload (multipart `file`, optional `purpose`), list, retrieve, content, delete.

Validation and storage belong to `MediaStore`; this module owns only the HTTP surface.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile

from mmserve.api.app import State
from mmserve.api.errors import APIError, from_engine_error
from mmserve.api.protocol import FileDeleted, FileList, FileObject
from mmserve.errors import InvalidRequestError

router = APIRouter()
_CHUNK = 1 << 20


# The body is parsed by hand (below); this documents it in /openapi.json for clients and fuzzers.
_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string"},
                    },
                }
            }
        },
    }
}


@router.post("/v1/files", openapi_extra=_UPLOAD_BODY)
async def upload(request: Request, state: State) -> FileObject:
    # Parsed by hand (not a `File()` parameter) so a missing field is our 400, not FastAPI's 422.
    form = await request.form(max_files=1, max_fields=8)
    try:
        file = form.get("file")
        if not isinstance(file, UploadFile):
            raise APIError(
                400, "file: a multipart field 'file' is required", code="missing_file", param="file"
            )
        purpose = form.get("purpose")
        purpose = purpose if isinstance(purpose, str) and purpose else "vision"

        async def chunks() -> AsyncIterator[bytes]:
            while chunk := await file.read(_CHUNK):
                yield chunk

        try:
            obj = await state.store.save(chunks(), file.filename or "upload", purpose)
        except (APIError, InvalidRequestError) as exc:
            err = from_engine_error(exc)
            state.metrics.count_upload("unknown", err.code or str(err.status))
            raise err from None
        state.metrics.count_upload(obj.media_type, "ok")
        return obj
    finally:
        await form.close()


@router.get("/v1/files")
async def list_files(state: State) -> FileList:
    return FileList(data=state.store.list())


@router.get("/v1/files/{file_id}")
async def retrieve(file_id: str, state: State) -> FileObject:
    return state.store.require(file_id)


@router.get("/v1/files/{file_id}/content")
async def content(file_id: str, state: State) -> FileResponse:
    obj = state.store.require(file_id)
    return FileResponse(state.store.blob_path(obj), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete(file_id: str, state: State) -> FileDeleted:
    if not state.store.delete(file_id):
        raise APIError(404, f"no file with id {file_id!r}", code="file_not_found", param="file_id")
    return FileDeleted(id=file_id, deleted=True)
