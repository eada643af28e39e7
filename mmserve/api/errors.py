"""OpenAI-shaped error bodies `{"error": {"message", "type", "param", "code"}}`, the engine error -> HTTP
status mapping and FastAPI's handlers. Only mmserve's own messages reach clients, never decoder text."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmserve.api.protocol import ErrorInfo, ErrorResponse
from mmserve.engine.async_engine import QueueFullError
from mmserve.engine.faults import RequestFailedError
from mmserve.errors import EngineDeadError, InvalidRequestError, MMServeError, PromptTooLongError
from mmserve.scheduler.slo import SloInfeasibleError

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "request_too_large", 431: "request_too_large", 415: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable"}  # fmt: skip

# Limit names in InvalidRequestError messages (see encoders/media.py) -> a specific error code.
_LIMIT_CODES = (
    ("max_items_per_prompt", "too_many_images"),
    ("max_image_pixels", "image_too_large"),
    ("max_image_bytes", "image_too_large"),
    ("max_video_bytes", "video_too_large"),
    ("max_video_frames", "video_too_large"),
    ("max_video_duration_s", "video_too_large"),
    ("max_video_pixels_per_frame", "video_too_large"),
)


class APIError(Exception):
    """An error the API answers with; `headers` e.g. Retry-After."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = headers

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=self.info()).model_dump()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def from_engine_error(exc: BaseException) -> APIError:
    """Engine / media exceptions -> APIError. Unknown exceptions become an opaque 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), code="prompt_too_long", param=exc.param)
    if isinstance(exc, InvalidRequestError):
        message = str(exc)
        code = next((c for limit, c in _LIMIT_CODES if limit in message), "invalid_request_error")
        return APIError(400, message, code=code, param=exc.param)
    if isinstance(exc, SloInfeasibleError):  # admission control "reject": its TTFT cannot be met now (or ever)
        retry = None if exc.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
        return APIError(429, str(exc), code="slo_infeasible", param="slo", headers=retry)
    if isinstance(exc, QueueFullError):
        retry = str(max(1, math.ceil(exc.retry_after)))
        return APIError(429, str(exc), code="queue_full", headers={"Retry-After": retry})
    if isinstance(exc, RequestFailedError):  # an engine fault that hit this request only
        return APIError(500, str(exc), type="server_error", code="request_failed")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable", headers={"Retry-After": "5"})
    if isinstance(exc, MMServeError):
        return APIError(500, str(exc), type="server_error", code="internal_error")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, "internal server error", type="server_error", code="internal_error")


def validation_error(errors: list[Any]) -> APIError:
    """Pydantic errors -> 422 (schema) or 400 (the body is not JSON at all)."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    msg = first.get("msg", "invalid request")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return APIError(422, f"{param or 'body'}: {msg}{more}", code="invalid_schema", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(MMServeError)
    async def _engine(_: Request, exc: MMServeError) -> JSONResponse:
        return from_engine_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status_code)
        if exc.status_code == 404:
            message = "not found"
        return APIError(exc.status_code, message, code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return from_engine_error(exc).response()
