"""The SDK's exception tree (mirrors openai-python) and the mapping from an HTTP error response to it.

Knows the wire error shape `{"error": {"message", "type", "param", "code"}}`; knows no transport.
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any

import httpx


class APIError(Exception):
    """Base of every error the SDK raises; also raised for an error event inside a stream or session."""

    def __init__(
        self,
        message: str,
        *,
        body: Any = None,
        code: str | None = None,
        type: str | None = None,
        param: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.body = body
        self.code = code
        self.type = type
        self.param = param
        self.request_id = request_id
        self.status_code: int | None = None


class APIStatusError(APIError):
    """The server answered with a 4xx/5xx status; `response` is the (already read) httpx response."""

    def __init__(
        self, message: str, *, response: httpx.Response | None, status_code: int, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.response = response
        self.status_code = status_code
        # Seconds the server asked us to wait (`Retry-After`), e.g. on 429/503; None if absent.
        self.retry_after: float | None = None

    def __str__(self) -> str:
        code = f" ({self.code})" if self.code else ""
        return f"Error code: {self.status_code}{code} - {self.message}"


class BadRequestError(APIStatusError):
    """400."""


class AuthenticationError(APIStatusError):
    """401."""


class PermissionDeniedError(APIStatusError):
    """403."""


class NotFoundError(APIStatusError):
    """404."""


class ConflictError(APIStatusError):
    """409."""


class RequestTooLargeError(APIStatusError):
    """413: the body or upload exceeds a server size limit."""


class UnsupportedMediaTypeError(APIStatusError):
    """415: the upload's content is not a supported image or video."""


class UnprocessableEntityError(APIStatusError):
    """422: the request does not match the schema."""


class RateLimitError(APIStatusError):
    """429: the waiting queue is full; see `retry_after`."""


class InternalServerError(APIStatusError):
    """5xx."""


class APIConnectionError(APIError):
    """No usable HTTP response: connection refused or reset, a broken stream, a closed WebSocket."""

    def __init__(self, message: str = "Connection error.", *, request_id: str | None = None) -> None:
        super().__init__(message, request_id=request_id)


class APITimeoutError(APIConnectionError):
    """The request (or the WebSocket handshake) timed out."""

    def __init__(self, message: str = "Request timed out.") -> None:
        super().__init__(message)


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: RequestTooLargeError,
    415: UnsupportedMediaTypeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def error_fields(body: Any) -> dict[str, Any]:
    """The `message/code/type/param` of an OpenAI-shaped error body (missing keys -> None)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return {"message": None, "code": None, "type": None, "param": None}
    code = err.get("code")
    return {
        "message": err.get("message") if isinstance(err.get("message"), str) else None,
        "code": str(code) if code is not None else None,
        "type": err.get("type"),
        "param": err.get("param"),
    }


def parse_retry_after(headers: Any) -> float | None:
    """Seconds from `retry-after-ms` or `Retry-After` (seconds or an HTTP date); None if absent/invalid."""
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def status_error(
    status_code: int, body_bytes: bytes, headers: httpx.Headers | Any, response: httpx.Response | None = None
) -> APIStatusError:
    """The APIStatusError subclass for `status_code`, filled from the error body and `x-request-id`."""
    try:
        body: Any = json.loads(body_bytes) if body_bytes else None
    except ValueError:
        body = body_bytes.decode("utf-8", "replace")
    fields = error_fields(body)
    message = fields.pop("message") or (body if isinstance(body, str) and body else f"HTTP {status_code}")
    cls = _BY_STATUS.get(status_code) or (InternalServerError if status_code >= 500 else APIStatusError)
    err = cls(
        message,
        response=response,
        status_code=status_code,
        body=body,
        request_id=headers.get("x-request-id") if headers is not None else None,
        **fields,
    )
    err.retry_after = parse_retry_after(headers)
    return err
