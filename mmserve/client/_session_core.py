"""What both WebSocket session flavours share: the URL, event builders, and the `Router` that sends each
server event to its response's `HandleState` (by response id, or by the `event_id` an error echoes).

Knows the WS event protocol; owns no socket, thread or task.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from websockets.exceptions import InvalidStatus

from mmserve.client.errors import APIConnectionError, APIError, APITimeoutError, error_fields, status_error
from mmserve.client.types import SessionResult, Usage

WS_PATH = "/v1/chat/ws"
MAX_MESSAGE_BYTES = 16 * 2**20  # incoming events are small; this only bounds a misbehaving server


def ws_url(base_url: str) -> str:
    """`http://h:8000` -> `ws://h:8000/v1/chat/ws` (https -> wss)."""
    if base_url.startswith("https://"):
        return "wss://" + base_url[len("https://") :] + WS_PATH
    if base_url.startswith("http://"):
        return "ws://" + base_url[len("http://") :] + WS_PATH
    return base_url + WS_PATH


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def error_from_event(event: Mapping[str, Any]) -> APIError:
    fields = error_fields(event)
    message = fields.pop("message") or "WebSocket error event"
    return APIError(message, body=dict(event), **fields)


def handshake_error(exc: BaseException) -> APIError:
    if isinstance(exc, InvalidStatus):
        r = exc.response
        return status_error(r.status_code, bytes(r.body or b""), r.headers)
    if isinstance(exc, TimeoutError):
        return APITimeoutError("WebSocket handshake timed out.")
    return APIConnectionError(f"WebSocket connection failed: {exc}")


def build_create_event(
    messages: Iterable[Mapping[str, Any]], response_id: str, event_id: str, params: Mapping[str, Any]
) -> dict[str, Any]:
    response: dict[str, Any] = {"id": response_id, "messages": [dict(m) for m in messages]}
    response.update({k: v for k, v in params.items() if v is not None})
    return {"type": "response.create", "event_id": event_id, "response": response}


class HandleState:
    """One response's progress; `_changed()` wakes waiters (thread or task flavour)."""

    def __init__(self, response_id: str, event_id: str) -> None:
        self.id = response_id
        self.event_id = event_id
        self.created = False  # the server acknowledged it with `response.created`
        self._deltas: list[str] = []
        self._result: SessionResult | None = None
        self._error: APIError | None = None

    @property
    def done(self) -> bool:
        return self._result is not None or self._error is not None

    @property
    def text(self) -> str:
        """Text received so far (the whole output once done)."""
        if self._result is not None and self._result.output_text and not self._deltas:
            return self._result.output_text
        return "".join(self._deltas)

    @property
    def status(self) -> str:
        """`pending` until created, then `in_progress`, then the final status (`failed` on an error event)."""
        if self._result is not None:
            return self._result.status
        if self._error is not None:
            return "failed"
        return "in_progress" if self.created else "pending"

    @property
    def result(self) -> SessionResult | None:
        return self._result

    @property
    def usage(self) -> Usage | None:
        return self._result.usage if self._result is not None else None

    @property
    def error(self) -> APIError | None:
        return self._error

    def _changed(self) -> None:
        raise NotImplementedError

    # Called by the reader (under the session lock for the sync flavour).
    def _on_created(self, server_id: str) -> None:
        self.id, self.created = server_id, True
        self._changed()

    def _on_delta(self, delta: str) -> None:
        if not self.done:
            self._deltas.append(delta)
            self._changed()

    def _on_done(self, result: SessionResult) -> None:
        if not self.done:
            self._result = result
            self._changed()

    def _on_error(self, error: APIError) -> None:
        if not self.done:
            self._error = error
            self._changed()


class Router:
    """Routes decoded server events to handles; shared by both session flavours."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, HandleState] = {}
        self._by_event: dict[str, HandleState] = {}
        # Handles sent but not yet acknowledged, in send order: a server that assigns its own ids
        # acknowledges `response.create`s in order, so an unknown id belongs to the oldest of these.
        self._awaiting: deque[HandleState] = deque()
        self.session_info: dict[str, Any] | None = None
        self.errors: list[APIError] = []  # error events that belong to no live response

    def _register(self, handle: HandleState) -> None:
        with self._lock:
            self._by_id[handle.id] = handle
            self._by_event[handle.event_id] = handle
            self._awaiting.append(handle)

    def _unregister(self, handle: HandleState) -> None:
        with self._lock:
            self._by_id.pop(handle.id, None)
            self._by_event.pop(handle.event_id, None)
            if handle in self._awaiting:
                self._awaiting.remove(handle)

    def _dispatch(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        raw = event.get("response")
        response: dict[str, Any] = raw if isinstance(raw, dict) else {}
        with self._lock:
            if kind == "session.created":
                self.session_info = dict(event)
                self._on_session_created()
            elif kind == "response.created":
                rid = str(response.get("id"))
                handle = self._by_id.get(rid)
                if handle is None and self._awaiting:
                    handle = self._awaiting[0]
                    self._by_id[rid] = handle
                if handle is not None:
                    if handle in self._awaiting:
                        self._awaiting.remove(handle)
                    handle._on_created(rid)
            elif kind == "response.output_text.delta":
                handle = self._by_id.get(str(event.get("response_id")))
                if handle is not None:
                    handle._on_delta(str(event.get("delta", "")))
            elif kind == "response.done":
                rid = str(response.get("id"))
                handle = self._by_id.pop(rid, None)
                if handle is not None:
                    self._by_event.pop(handle.event_id, None)
                    handle._on_done(SessionResult.model_validate(response))
            elif kind == "error":
                err = error_from_event(event)
                handle = self._by_event.get(str(event.get("event_id"))) or self._by_id.get(
                    str(event.get("response_id"))
                )
                if handle is None or handle.done:
                    self.errors.append(err)
                else:
                    self._by_id.pop(handle.id, None)
                    self._by_event.pop(handle.event_id, None)
                    if handle in self._awaiting:
                        self._awaiting.remove(handle)
                    handle._on_error(err)
            # Unknown event types are ignored: a newer server may send more.

    def _fail_all(self, error: APIError) -> None:
        with self._lock:
            handles = list(self._by_event.values()) + list(self._by_id.values())
            self._by_id.clear()
            self._by_event.clear()
            self._awaiting.clear()
        for handle in handles:
            handle._on_error(error)

    def _on_session_created(self) -> None:
        raise NotImplementedError
