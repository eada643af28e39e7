"""`ChatSession`: a WebSocket chat session on /v1/chat/ws read by a background thread; `SessionResponse` handles.

Several responses share one socket; the client picks each response's id. Never retried.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

import websockets
import websockets.sync.client
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

# websockets >= 17 warns unless a directly-held sync connection opts into `legacy=True`; older ones lack it.
_SYNC_CONNECT_EXTRA: dict[str, Any] = (
    {"legacy": True} if "legacy" in inspect.signature(websockets.sync.client.connect).parameters else {}
)


class SessionResponse(HandleState):
    """A response in a `ChatSession`: iterate for text deltas, `wait()` for the final result, `cancel()`."""

    def __init__(self, session: ChatSession, response_id: str, event_id: str) -> None:
        super().__init__(response_id, event_id)
        self._session = session
        self._cond = threading.Condition()

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def __iter__(self) -> Iterator[str]:
        """Text deltas as they arrive; ends when the response is done, raises if it failed with an error."""
        i = 0
        while True:
            with self._cond:
                while i >= len(self._deltas) and not self.done:
                    self._cond.wait()
                if i < len(self._deltas):
                    delta = self._deltas[i]
                elif self._error is not None:
                    raise self._error
                else:
                    return
            i += 1
            yield delta

    def wait(self, timeout: float | None = None) -> SessionResult:
        """Block until `response.done`; its result (any status). Raises on an error event or a lost socket."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise APITimeoutError(f"Response {self.id} not done after {timeout}s.")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def cancel(self) -> None:
        """Ask the server to stop this response (its `response.done` then says `cancelled`)."""
        if not self.done:
            self._session._send_event({"type": "response.cancel", "response_id": self.id})


class ChatSession(Router):
    """One WebSocket; `send()` starts a response; a reader thread routes events to the handles."""

    def __init__(self, base_url: str, api_key: str | None, *, open_timeout: float | None = 10.0) -> None:
        super().__init__()
        self.url = ws_url(base_url)
        self._api_key = api_key
        self._open_timeout = open_timeout
        self._ws: websockets.sync.client.ClientConnection | None = None
        self._reader: threading.Thread | None = None
        self._created = threading.Event()
        self._send_lock = threading.Lock()

    def _on_session_created(self) -> None:
        self._created.set()

    def connect(self) -> ChatSession:
        """Open the socket (handshake errors map to APIStatusError subclasses) and wait for `session.created`."""
        headers = {k: v for k, v in default_headers(self._api_key).items() if k != "Accept"}
        try:
            self._ws = websockets.sync.client.connect(
                self.url, additional_headers=headers, open_timeout=self._open_timeout,
                max_size=MAX_MESSAGE_BYTES, **_SYNC_CONNECT_EXTRA,
            )  # fmt: skip
        except (InvalidStatus, OSError, TimeoutError, websockets.exceptions.InvalidHandshake) as exc:
            raise handshake_error(exc) from exc
        self._reader = threading.Thread(target=self._read_loop, name="mmserve-ws-reader", daemon=True)
        self._reader.start()
        if not self._created.wait(self._open_timeout):
            self.close()
            raise APITimeoutError("No session.created from the server.")
        return self

    def _read_loop(self) -> None:
        assert self._ws is not None
        reason = "WebSocket closed."
        try:
            for message in self._ws:
                try:
                    event = json.loads(message)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    self._dispatch(event)
        except ConnectionClosed as exc:
            reason = f"WebSocket closed: {exc}"
        finally:
            self._created.set()  # unblock connect() if the socket died before session.created
            self._fail_all(APIConnectionError(reason))

    def _send_event(self, event: Mapping[str, Any]) -> None:
        if self._ws is None:
            raise APIConnectionError("Session is not connected; use `with client.chat.session() as s:`.")
        try:
            with self._send_lock:
                self._ws.send(json.dumps(event))
        except ConnectionClosed as exc:
            raise APIConnectionError(f"WebSocket closed: {exc}") from exc

    def send(
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
    ) -> SessionResponse:
        """Send `response.create`; returns at once with the response's handle."""
        handle = SessionResponse(self, id or new_id("resp"), new_id("evt"))
        params = dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=stop, ignore_eos=ignore_eos, priority=priority,
            service_tier=service_tier, slo=dict(slo) if slo is not None else None, **extra,
        )  # fmt: skip
        self._register(handle)
        try:
            self._send_event(build_create_event(messages, handle.id, handle.event_id, params))
        except APIError:
            self._unregister(handle)
            raise
        return handle

    def close(self) -> None:
        """Close the socket (the server aborts its responses); unfinished handles fail with APIConnectionError."""
        if self._ws is not None:
            self._ws.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5.0)
        self._fail_all(APIConnectionError("Session closed."))

    def __enter__(self) -> ChatSession:
        return self.connect()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
