"""`AsyncChatSession`: the asyncio twin of `ChatSession` (the reader is a task on the caller's loop).

Never retried.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable, Mapping
from types import TracebackType
from typing import Any

import websockets
import websockets.asyncio.client
from websockets.exceptions import ConnectionClosed, InvalidStatus

from mmserve.client._base import default_headers
from mmserve.client._session_core import (
    MAX_MESSAGE_BYTES,
    HandleState,
    Router,
    build_create_event,
    handshake_error,
    new_id,
    ws_url,
)
from mmserve.client.errors import APIConnectionError, APIError, APITimeoutError
from mmserve.client.types import ServiceTier, SessionResult, SLOTargets


class AsyncSessionResponse(HandleState):
    """Async twin of `SessionResponse`: `async for delta in r`, `await r.wait()`, `await r.cancel()`."""

    def __init__(self, session: AsyncChatSession, response_id: str, event_id: str) -> None:
        super().__init__(response_id, event_id)
        self._session = session
        self._event = asyncio.Event()  # replaced on every change; waiters hold the old one

    def _changed(self) -> None:
        old, self._event = self._event, asyncio.Event()
        old.set()

    async def __aiter__(self) -> AsyncIterator[str]:
        i = 0
        while True:
            if i < len(self._deltas):
                i += 1
                yield self._deltas[i - 1]
            elif self._error is not None:
                raise self._error
            elif self.done:
                return
            else:
                await self._event.wait()

    async def wait(self, timeout: float | None = None) -> SessionResult:
        async def until_done() -> None:
            while not self.done:
                await self._event.wait()

        try:
            await asyncio.wait_for(until_done(), timeout)
        except asyncio.TimeoutError as exc:
            raise APITimeoutError(f"Response {self.id} not done after {timeout}s.") from exc
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    async def cancel(self) -> None:
        if not self.done:
            await self._session._send_event({"type": "response.cancel", "response_id": self.id})


class AsyncChatSession(Router):
    """Async twin of `ChatSession`; the reader is a task on the caller's event loop."""

    def __init__(self, base_url: str, api_key: str | None, *, open_timeout: float | None = 10.0) -> None:
        super().__init__()
        self.url = ws_url(base_url)
        self._api_key = api_key
        self._open_timeout = open_timeout
        self._ws: websockets.asyncio.client.ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._created = asyncio.Event()

    def _on_session_created(self) -> None:
        self._created.set()

    async def connect(self) -> AsyncChatSession:
        headers = {k: v for k, v in default_headers(self._api_key).items() if k != "Accept"}
        try:
            self._ws = await websockets.asyncio.client.connect(
                self.url, additional_headers=headers, open_timeout=self._open_timeout,
                max_size=MAX_MESSAGE_BYTES,
            )  # fmt: skip
        except (InvalidStatus, OSError, TimeoutError, websockets.exceptions.InvalidHandshake) as exc:
            raise handshake_error(exc) from exc
        self._reader = asyncio.create_task(self._read_loop())
        try:
            await asyncio.wait_for(self._created.wait(), self._open_timeout)
        except asyncio.TimeoutError as exc:
            await self.close()
            raise APITimeoutError("No session.created from the server.") from exc
        return self

    async def _read_loop(self) -> None:
        assert self._ws is not None
        reason = "WebSocket closed."
        try:
            async for message in self._ws:
                try:
                    event = json.loads(message)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    self._dispatch(event)
        except ConnectionClosed as exc:
            reason = f"WebSocket closed: {exc}"
        finally:
            self._created.set()
            self._fail_all(APIConnectionError(reason))

    async def _send_event(self, event: Mapping[str, Any]) -> None:
        if self._ws is None:
            raise APIConnectionError(
                "Session is not connected; use `async with client.chat.session() as s:`."
            )
        try:
            await self._ws.send(json.dumps(event))
        except ConnectionClosed as exc:
            raise APIConnectionError(f"WebSocket closed: {exc}") from exc

    async def send(
        self,
        messages: Iterable[Mapping[str, Any]],
        *,
        id: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        ignore_eos: bool | None = None,
        priority: int | None = None,
        service_tier: ServiceTier | None = None,
        slo: SLOTargets | Mapping[str, float] | None = None,
        **extra: Any,
    ) -> AsyncSessionResponse:
        handle = AsyncSessionResponse(self, id or new_id("resp"), new_id("evt"))
        params = dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=stop, ignore_eos=ignore_eos, priority=priority,
            service_tier=service_tier, slo=dict(slo) if slo is not None else None, **extra,
        )  # fmt: skip
        self._register(handle)
        try:
            await self._send_event(build_create_event(messages, handle.id, handle.event_id, params))
        except APIError:
            self._unregister(handle)
            raise
        return handle

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            try:
                await asyncio.wait_for(self._reader, 5.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._reader.cancel()
        self._fail_all(APIConnectionError("Session closed."))

    async def __aenter__(self) -> AsyncChatSession:
        return await self.connect()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
