"""`WS /v1/chat/ws`: concurrent chat responses over one socket (Realtime-like events, see docs/api.md).
Each response is one task; cancelling it closes its engine stream (abort); closing the socket cancels all.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import TypeAdapter, ValidationError

from mmserve.api import convert
from mmserve.api.app import ServerState, check_api_key
from mmserve.api.errors import APIError, from_engine_error, validation_error
from mmserve.api.protocol import (
    ClientEvent,
    ResponseCancelEvent,
    ResponseCreateEvent,
    ResponseObject,
    ResponseStatus,
    response_event,
)
from mmserve.engine.output_processor import RequestOutput

router = APIRouter()
_client_event: TypeAdapter[ResponseCreateEvent | ResponseCancelEvent] = TypeAdapter(ClientEvent)
_STATUS: dict[str | None, ResponseStatus] = {
    "stop": "completed",
    "length": "incomplete",
    "abort": "cancelled",
}


class _Session:
    def __init__(self, ws: WebSocket, state: ServerState) -> None:
        self.ws, self.state = ws, state
        self.id = f"sess_{uuid.uuid4().hex}"
        self.responses: dict[str, asyncio.Task[None]] = {}
        self.started: set[str] = set()  # responses whose task has begun (so task.cancel() reaches it)
        self.cancel_requested: set[str] = set()  # cancelled before their task began
        self._send_lock = asyncio.Lock()  # one frame at a time from many response tasks
        self.closed = False

    async def send(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        async with self._send_lock:
            try:
                await self.ws.send_text(json.dumps(event, separators=(",", ":")))
            except Exception:  # the peer is gone; the receive loop notices and cleans up
                self.closed = True

    async def error(self, err: APIError, event_id: str | None = None, response_id: str | None = None) -> None:
        event: dict[str, Any] = {"type": "error", "error": err.info().model_dump()}
        if event_id is not None:
            event["event_id"] = event_id
        if response_id is not None:
            event["response_id"] = response_id
        await self.send(event)

    async def handle(self, text: str) -> None:
        if len(text.encode()) > self.state.settings.max_ws_message_bytes:
            limit = self.state.settings.max_ws_message_bytes
            await self.error(APIError(413, f"the message exceeds {limit} bytes", code="message_too_large"))
            return
        try:
            event = _client_event.validate_json(text)
        except ValidationError as exc:
            event_id = _event_id(text)
            await self.error(validation_error(list(exc.errors(include_url=False))), event_id)
            return
        if isinstance(event, ResponseCancelEvent):
            task = self.responses.get(event.response_id)
            if task is None:
                err = APIError(404, f"no response {event.response_id!r} in progress", code="response_not_found",
                               param="response_id")  # fmt: skip
                await self.error(err, event.event_id)
            elif event.response_id in self.started:
                task.cancel()
            else:  # a task cancelled before its first step would never run: let it end itself
                self.cancel_requested.add(event.response_id)
            return
        response_id = event.response.id or f"resp_{uuid.uuid4().hex}"
        if response_id in self.responses:
            err = APIError(400, f"response id {response_id!r} is already in progress", code="duplicate_response_id",
                           param="response.id")  # fmt: skip
            await self.error(err, event.event_id)
            return
        self.responses[response_id] = asyncio.create_task(self.run(event, response_id))

    async def run(self, event: ResponseCreateEvent, response_id: str) -> None:
        state = self.state
        self.started.add(response_id)
        out: RequestOutput | None = None
        text = ""
        try:
            created = ResponseObject(id=response_id, status="in_progress")
            await self.send(response_event("response.created", created))
            if response_id in self.cancel_requested:
                raise asyncio.CancelledError
            messages, counts = await state.resolver.resolve(event.response.messages)
            params = convert.sampling_params(event.response, state.engine.max_model_len)
            engine_id = f"{self.id}-{response_id}"
            state.metrics.count_media(counts)
            async with aclosing(state.engine.chat(messages, params, engine_id)) as stream:
                async for out in stream:
                    if out.new_text:
                        text += out.new_text
                        await self.send({"type": "response.output_text.delta", "response_id": response_id,
                                         "delta": out.new_text})  # fmt: skip
            status = _STATUS.get(out.finish_reason if out else None, "failed")
            await self._done(response_id, status, text, out)
        except asyncio.CancelledError:  # response.cancel, or the socket closed (then nothing is sent)
            await self._done(response_id, "cancelled", text, out)
        except Exception as exc:  # one response fails, the socket stays open
            err = from_engine_error(exc)
            await self.error(err, event.event_id, response_id)
            await self._done(response_id, "failed", text, out, err)
        finally:
            self.responses.pop(response_id, None)
            self.started.discard(response_id)
            self.cancel_requested.discard(response_id)

    async def _done(
        self, response_id: str, status: ResponseStatus, text: str, out: RequestOutput | None,
        err: APIError | None = None,
    ) -> None:  # fmt: skip
        response = ResponseObject(
            id=response_id, status=status, output_text=text,
            finish_reason="cancelled" if status == "cancelled" else (out.finish_reason if out else None),
            usage=convert.usage(out) if out else None,
            metrics=convert.response_metrics(out) if out else None,
            error=err.info() if err else None,
        )  # fmt: skip
        await self.send(response_event("response.done", response))

    async def close(self) -> None:
        self.closed = True
        tasks = list(self.responses.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@router.websocket("/v1/chat/ws")
async def chat_ws(ws: WebSocket) -> None:
    state: ServerState = ws.app.state.mm
    if not check_api_key(state.settings, ws.headers.get("authorization"), ws.query_params.get("api_key")):
        # Refused at the handshake with HTTP 401 and OpenAI's error body, as the HTTP routes do.
        denial = APIError(
            401, "missing or invalid API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
        )
        try:
            await ws.send_denial_response(denial.response())
        except RuntimeError:  # a server without the denial-response extension: close (HTTP 403)
            await ws.close(code=1008, reason="missing or invalid API key")
        return
    await ws.accept()
    session = _Session(ws, state)
    await session.send({"type": "session.created", "session": {"id": session.id, "model": state.model_name}})
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            text = message.get("text")
            if text is None:
                data = message.get("bytes") or b""
                text = data.decode("utf-8", errors="replace")
            await session.handle(text)
    except WebSocketDisconnect:
        pass
    finally:
        await session.close()


def _event_id(text: str) -> str | None:
    try:
        value = json.loads(text).get("event_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
