"""ASGI middleware capping request body size: by Content-Length up front, and by counting bytes while
the body streams in (chunked uploads), so an oversized body is refused with 413 before it is stored."""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mmserve.api.errors import APIError


class BodyTooLarge(HTTPException):
    """Raised from `receive`; FastAPI re-raises HTTPExceptions from body parsing, so it reaches a handler."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds {limit} bytes")


class BodySizeLimit:
    def __init__(self, app: ASGIApp, limit_for: Callable[[Scope], int]) -> None:
        self.app = app
        self.limit_for = limit_for  # scope -> byte cap for that route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await APIError(
                    413, f"the request body exceeds {limit} bytes", code="body_too_large"
                ).response()(scope, receive, send)
                return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as exc:
            if started:
                raise
            await APIError(413, str(exc.detail), code="body_too_large").response()(scope, receive, send)


class HeaderSizeLimit:
    """Caps the request line and headers together (h11's own cap only bites on a head that arrives in
    pieces): 431 for HTTP, a refused handshake for WebSocket."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        size += sum(len(name) + len(value) + 4 for name, value in scope.get("headers", ()))  # ": " CRLF
        if size <= self.limit:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1009})
            return
        error = APIError(431, f"the request headers exceed {self.limit} bytes", code="headers_too_large")
        await error.response()(scope, receive, send)
