"""`WS /v1/chat/ws`: concurrent chat responses over one socket (Realtime-like events, see docs/api.md).
Each response is one task; cancelling it closes its engine stream (abort); closing the socket cancels all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
import uuid
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import TypeAdapter, ValidationError

from mmserve.api import convert
from mmserve.api.app import ServerState, check_api_key
from mmserve.api.chat_request import prepare_chat
from mmserve.api.errors import APIError, from_engine_error, validation_error
from mmserve.api.limits import bearer, key_id
from mmserve.api.openai_routes import refuse_unsupported
from mmserve.api.protocol import (
    ClientEvent,
    FunctionCallOut,
    ResponseCancelEvent,
    ResponseCreateEvent,
    ResponseObject,
    ResponseStatus,
    ToolCallOut,
    response_event,
)
from mmserve.engine.output_processor import RequestOutput

if TYPE_CHECKING:
    from mmserve.api.tool_parsers import ToolCallDelta

logger = logging.getLogger(__name__)
router = APIRouter()
_client_event: TypeAdapter[ResponseCreateEvent | ResponseCancelEvent] = TypeAdapter(ClientEvent)
_STATUS: dict[str | None, ResponseStatus] = {
    "stop": "completed",
    "length": "incomplete",
    "abort": "cancelled",
}


class _Session:
    """One socket. Events go through a bounded outbox drained by one writer task, so a response task
    never waits on the peer: a client that stops reading fills the outbox (or stalls one frame past
    `ws_send_timeout_s`) and is dropped, its responses aborted, without slowing any other socket."""

    def __init__(self, ws: WebSocket, state: ServerState, key: str) -> None:
        self.ws, self.state, self.key = ws, state, key
        self.id = f"sess_{uuid.uuid4().hex}"
        self.responses: dict[str, asyncio.Task[None]] = {}
        self.started: set[str] = set()  # responses whose task has begun (so task.cancel() reaches it)
        self.cancel_requested: set[str] = set()  # cancelled before their task began
        self._outbox: asyncio.Queue[str] = asyncio.Queue(maxsize=state.settings.ws_send_queue_events)
        self.gone = asyncio.Event()  # the peer is gone or was dropped: the socket handler ends
        self.closed = False
        self.drop_reason: str | None = None
        self._writer = asyncio.create_task(self._write_loop())

    async def send(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        try:
            self._outbox.put_nowait(json.dumps(event, separators=(",", ":")))
        except asyncio.QueueFull:
            self.drop(f"{self._outbox.maxsize} events are waiting to be sent (ws_send_queue_events)")

    def drop(self, reason: str) -> None:
        """Give up on a peer that does not read; the handler then cancels every response (abort)."""
        if not self.closed:
            logger.warning("dropping WebSocket session %s: %s", self.id, reason)
            self.drop_reason = reason
        self.closed = True
        self.gone.set()

    async def _write_loop(self) -> None:
        timeout = self.state.settings.ws_send_timeout_s
        while True:
            text = await self._outbox.get()
            try:
                if sys.version_info >= (
                    3,
                    11,
                ):  # a deadline on this task: no task per frame, as wait_for made
                    async with asyncio.timeout(timeout):
                        await self.ws.send_text(text)
                else:
                    await asyncio.wait_for(self.ws.send_text(text), timeout)
            except asyncio.TimeoutError:  # TimeoutError from 3.11 on
                self.drop(f"a frame waited {timeout} s to be sent (ws_send_timeout_s)")
                return
            except Exception:  # the peer is gone
                self.closed = True
                self.gone.set()
                return

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
        self.responses[response_id] = asyncio.create_task(self.run(event, response_id, time.monotonic()))

    async def run(self, event: ResponseCreateEvent, response_id: str, arrival_time: float) -> None:
        """`arrival_time`: when the event was received (TTFT counts from there)."""
        state = self.state
        self.started.add(response_id)
        out: RequestOutput | None = None
        text = ""
        calls: list[ToolCallDelta] = []
        release = None
        try:
            release = state.limiter.acquire(self.key)  # 429 error event if the key has no slot left
            created = ResponseObject(id=response_id, status="in_progress")
            await self.send(response_event("response.created", created))
            if response_id in self.cancel_requested:
                raise asyncio.CancelledError
            fields = event.response
            refuse_unsupported(fields)
            if fields.kv_transfer_params is not None:  # a router or proxy speaks it over HTTP, never here
                raise APIError(400, "kv_transfer_params: prefill/decode disaggregation is served over HTTP "
                               "(/v1/chat/completions, /v1/completions)", code="unsupported_parameter",
                               param="kv_transfer_params")  # fmt: skip
            if fields.n != 1:  # one output_text per response: ask for several responses instead
                raise APIError(400, "n: a WebSocket response has one output; send several response.create",
                               code="unsupported_parameter", param="n")  # fmt: skip
            chat = await prepare_chat(state, fields)
            engine_id = f"{self.id}-{response_id}"
            state.metrics.count_media(chat.counts)
            reader = chat.tool_parser.stream(tools=chat.tools) if chat.tool_parser is not None else None
            stream = state.engine.chat(
                chat.messages, chat.params, engine_id, arrival_time=arrival_time, **chat.template
            )
            async with aclosing(stream):
                async for out in stream:
                    if len(out.token_ids) == len(out.new_token_ids):  # the first output: the prompt is known
                        convert.check_max_tokens(fields.max_tokens, len(out.prompt_token_ids),
                                                 state.engine.max_model_len)  # fmt: skip
                    delta = out.new_text
                    if reader is not None:
                        parts = [reader.feed(out.new_text)] + ([reader.finish()] if out.finished else [])
                        delta = "".join(p.content or "" for p in parts)
                        calls.extend(c for p in parts for c in p.tool_calls)
                    if delta:
                        text += delta
                        await self.send({"type": "response.output_text.delta", "response_id": response_id,
                                         "delta": delta})  # fmt: skip
            status = _STATUS.get(out.finish_reason if out else None, "failed")
            if out is not None and out.finish_reason == "abort" and out.stop_reason == "shutdown":
                status = "incomplete"  # the server ended it while shutting down, not the client
            await self._done(response_id, status, text, out, tool_calls=_tool_calls(calls))
        except asyncio.CancelledError:  # response.cancel, or the socket closed (then nothing is sent)
            await self._done(response_id, "cancelled", text, out)
        except Exception as exc:  # one response fails, the socket stays open
            err = from_engine_error(exc)
            await self.error(err, event.event_id, response_id)
            await self._done(response_id, "failed", text, out, err)
        finally:
            if release is not None:
                release()
            self.responses.pop(response_id, None)
            self.started.discard(response_id)
            self.cancel_requested.discard(response_id)

    async def _done(
        self, response_id: str, status: ResponseStatus, text: str, out: RequestOutput | None,
        err: APIError | None = None, tool_calls: list[ToolCallOut] | None = None,
    ) -> None:  # fmt: skip
        finish_reason = "cancelled" if status == "cancelled" else (out.finish_reason if out else None)
        if tool_calls and status == "completed":
            finish_reason = "tool_calls"
        response = ResponseObject(
            id=response_id, status=status, output_text=text, tool_calls=tool_calls or None,
            finish_reason=finish_reason,
            usage=convert.usage(out) if out else None,
            metrics=convert.response_metrics(out) if out else None,
            error=err.info() if err else None,
            incomplete_details=(
                {"reason": "server_shutdown"}
                if out is not None and out.finish_reason == "abort" and out.stop_reason == "shutdown"
                else None
            ),
            service_tier=convert.service_tier(None, out) if out else None,  # "flex": served as batch
        )  # fmt: skip
        await self.send(response_event("response.done", response))

    async def close(self) -> None:
        self.closed = True
        tasks = list(self.responses.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._writer.cancel()
        await asyncio.gather(self._writer, return_exceptions=True)

    async def receive_loop(self) -> None:
        """Handles client events until the peer leaves or stays silent for `ws_idle_timeout_s` with no
        response in progress."""
        idle = self.state.settings.ws_idle_timeout_s
        try:
            while True:
                try:
                    message = await asyncio.wait_for(self.ws.receive(), idle)
                except TimeoutError:
                    if self.responses:
                        continue  # the client is waiting for output, not idle
                    logger.info("closing idle WebSocket session %s", self.id)
                    self.closed = True
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self.ws.close(code=1000, reason="idle timeout"), 1.0)
                    return
                if message["type"] == "websocket.disconnect":
                    return
                text = message.get("text")
                if text is None:
                    data = message.get("bytes") or b""
                    text = data.decode("utf-8", errors="replace")
                await self.handle(text)
        except (WebSocketDisconnect, RuntimeError):  # RuntimeError: receive after the socket closed
            return
        finally:
            self.gone.set()


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
    key = key_id(bearer(ws.headers.get("authorization"), ws.query_params.get("api_key")))
    session = _Session(ws, state, key)
    await session.send({"type": "session.created", "session": {"id": session.id, "model": state.model_name}})
    reader = asyncio.create_task(session.receive_loop())
    try:
        await session.gone.wait()  # the peer left, went idle, or was dropped for not reading
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await session.close()  # every response cancelled: their engine requests are aborted
        if session.drop_reason is not None:  # best effort: a peer that does not read may never take it
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(code=1008, reason="not reading"), 1.0)


def _tool_calls(deltas: list[ToolCallDelta]) -> list[ToolCallOut]:
    """The streamed fragments of the tool calls, joined into whole calls."""
    calls: dict[int, ToolCallOut] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCallOut(
                id=d.id or "", function=FunctionCallOut(name=d.name or "", arguments="")
            )
        calls[d.index].function.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def _event_id(text: str) -> str | None:
    try:
        value = json.loads(text).get("event_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
