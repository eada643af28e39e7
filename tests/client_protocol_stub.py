"""A protocol STUB of the mmserve server for the SDK's own unit tests: canned answers, no engine, no model.

It speaks the wire protocol of issue 4 (chat completions JSON/SSE, WS /v1/chat/ws, /v1/files, models,
health, OpenAI-shaped errors) on a free local port, and records what it saw. The last user message
selects a behaviour (`error:404:model_not_found`, `flaky503:KEY`, `slow`, `stream-drop`, ...).
The real server's tests live in tests/test_api*.py and tests/test_client_live.py.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import json
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

WORDS = ["Hello", " from", " the", " stub", "."]
MAX_UPLOAD = 64 * 1024


class StubState:
    """What the stub saw; tests read it (written on the server thread)."""

    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()  # behaviour key -> number of requests
        self.stream_closed_early = threading.Event()  # a `stream-long` SSE lost its client
        self.last_body: dict[str, Any] | None = None
        self.ws_events: list[dict[str, Any]] = []
        self.files: dict[str, tuple[dict[str, Any], bytes]] = {}


def _error(status: int, message: str, code: str | None, headers: dict[str, str] | None = None) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(
        body, status_code=status, headers={"x-request-id": f"req_{status}", **(headers or {})}
    )


def _last_text(messages: list[dict[str, Any]]) -> str:
    content = messages[-1].get("content", "") if messages else ""
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if p.get("type") == "text")
    return str(content)


def _authorized(headers: Any, api_key: str | None) -> bool:
    return api_key is None or headers.get("authorization") == f"Bearer {api_key}"


def _chunk(cid: str, delta: dict[str, Any], finish: str | None = None) -> str:
    obj = {"id": cid, "object": "chat.completion.chunk", "created": 0, "model": "stub-model",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
    return f"data: {json.dumps(obj)}\n\n"


def make_app(state: StubState, api_key: str | None = None) -> Starlette:
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        if not _authorized(request.headers, api_key):
            return _error(401, "Missing or invalid API key", "invalid_api_key")
        return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model", "created": 0,
                                                         "owned_by": "mmserve"}]})  # fmt: skip

    async def chat(request: Request) -> Response:
        if not _authorized(request.headers, api_key):
            return _error(401, "Missing or invalid API key", "invalid_api_key")
        body = await request.json()
        state.last_body = body
        text = _last_text(body.get("messages", []))
        state.attempts[text] += 1
        if text.startswith("error:"):
            _, status, code, *flags = text.split(":")  # flag "never": no Retry-After (no retry would succeed)
            extra = {"Retry-After": "2"} if status in ("429", "503") and "never" not in flags else None
            return _error(int(status), f"stub error {status}", code or None, extra)
        if text.startswith("flaky503:") and state.attempts[text] == 1:
            return _error(503, "queue full", "queue_full", {"Retry-After": "2"})
        if text == "slow":
            await asyncio.sleep(2.0)
        cid = f"chatcmpl-{uuid.uuid4().hex[:8]}"
        if not body.get("stream"):
            return JSONResponse(
                {"id": cid, "object": "chat.completion", "created": 0, "model": "stub-model",
                 "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(WORDS)},
                              "finish_reason": "stop", "logprobs": None}],
                 "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}},
                headers={"x-request-id": "req_ok"},
            )  # fmt: skip
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events() -> Any:
            yield _chunk(cid, {"role": "assistant", "content": ""})
            words = WORDS * 200 if text == "stream-long" else WORDS
            try:
                for i, word in enumerate(words):
                    if text == "stream-long":
                        await asyncio.sleep(0.01)
                    yield _chunk(cid, {"content": word})
                    if i == 1 and text == "stream-error":
                        err = {"error": {"message": "engine failed", "type": "server_error",
                                         "param": None, "code": "engine_error"}}  # fmt: skip
                        yield f"data: {json.dumps(err)}\n\n"
                        return
                    if i == 1 and text == "stream-drop":
                        return  # ends without [DONE]: a broken stream
            except BaseException:
                state.stream_closed_early.set()  # the client went away mid-stream (cancelled here)
                raise
            yield _chunk(cid, {}, "stop")
            if include_usage:
                usage = {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}
                yield f"data: {json.dumps({'id': cid, 'object': 'chat.completion.chunk', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"x-request-id": "req_sse"}
        )

    async def upload(request: Request) -> Response:
        if not _authorized(request.headers, api_key):
            return _error(401, "Missing or invalid API key", "invalid_api_key")
        raw = await request.body()
        if len(raw) > MAX_UPLOAD:
            return _error(413, "upload too large", "file_too_large")
        parts = _parse_multipart(request.headers["content-type"], raw)
        name, data = parts["file"]
        meta = _sniff(data)
        if meta is None:
            return _error(415, "unsupported media", "unsupported_media_type")
        fid = f"file-{uuid.uuid4().hex[:12]}"
        obj = {"id": fid, "object": "file", "bytes": len(data), "created_at": int(time.time()), "filename": name,
               "purpose": parts.get("purpose", (None, b"vision"))[1].decode(), **meta}  # fmt: skip
        state.files[fid] = (obj, data)
        return JSONResponse(obj)

    async def list_files(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [obj for obj, _ in state.files.values()]})

    async def file_route(request: Request) -> Response:
        fid = request.path_params["file_id"]
        if fid not in state.files:
            return _error(404, f"No such file: {fid}", "file_not_found")
        if request.method == "DELETE":
            del state.files[fid]
            return JSONResponse({"id": fid, "object": "file", "deleted": True})
        return JSONResponse(state.files[fid][0])

    async def file_content(request: Request) -> Response:
        fid = request.path_params["file_id"]
        if fid not in state.files:
            return _error(404, f"No such file: {fid}", "file_not_found")
        return Response(state.files[fid][1], media_type="application/octet-stream")

    async def chat_ws(ws: WebSocket) -> None:
        if not _authorized(ws.headers, api_key):
            await ws.send_denial_response(_error(401, "Missing or invalid API key", "invalid_api_key"))
            return
        await ws.accept()
        await ws.send_json({"type": "session.created", "session": {"id": "sess_stub"}})
        tasks: dict[str, asyncio.Task[None]] = {}
        send_lock = asyncio.Lock()

        async def send(obj: dict[str, Any]) -> None:
            async with send_lock:
                await ws.send_json(obj)

        async def run(rid: str, text: str) -> None:
            parts: list[str] = []
            status = "completed"
            try:
                await send({"type": "response.created", "response": {"id": rid, "status": "in_progress"}})
                words = WORDS * 100 if text == "ws-slow" else WORDS
                for word in words:
                    await asyncio.sleep(0.01)
                    parts.append(word)
                    await send({"type": "response.output_text.delta", "response_id": rid, "delta": word})
            except asyncio.CancelledError:
                status = "cancelled"
            usage = {"prompt_tokens": 3, "completion_tokens": len(parts), "total_tokens": 3 + len(parts)}
            await send({"type": "response.done", "response": {
                "id": rid, "status": status, "output_text": "".join(parts),
                "finish_reason": "stop" if status == "completed" else "abort", "usage": usage,
                "metrics": {"ttft_ms": 1.0, "tokens_per_s": 100.0}}})  # fmt: skip

        try:
            while True:
                event = await ws.receive_json()
                state.ws_events.append(event)
                if event.get("type") == "response.create":
                    resp = event["response"]
                    text = _last_text(resp.get("messages", []))
                    if text == "ws-error":
                        await send({"type": "error", "event_id": event.get("event_id"), "error": {
                            "type": "invalid_request_error", "code": "too_many_images",
                            "message": "too many images", "param": "messages"}})  # fmt: skip
                        continue
                    rid = resp.get("id") or f"resp_{uuid.uuid4().hex[:8]}"
                    tasks[rid] = asyncio.create_task(run(rid, text))
                elif event.get("type") == "response.cancel":
                    task = tasks.get(event.get("response_id", ""))
                    if task is not None and not task.done():
                        task.cancel()
        except WebSocketDisconnect:
            for task in tasks.values():
                task.cancel()

    return Starlette(routes=[
        Route("/health", health), Route("/v1/models", models),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/files", upload, methods=["POST"]), Route("/v1/files", list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", file_route, methods=["GET", "DELETE"]),
        Route("/v1/files/{file_id}/content", file_content),
        WebSocketRoute("/v1/chat/ws", chat_ws),
    ])  # fmt: skip


def _parse_multipart(content_type: str, raw: bytes) -> dict[str, tuple[str | None, bytes]]:
    """name -> (filename, bytes); the stdlib's MIME parser, so the stub needs no python-multipart."""
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + raw
    )
    out: dict[str, tuple[str | None, bytes]] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        out[str(name)] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return out


def _sniff(data: bytes) -> dict[str, Any] | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return {"media_type": "image", "width": width, "height": height}
    if data[4:8] == b"ftyp":
        return {"media_type": "video", "width": 64, "height": 48, "num_frames": 8, "duration_s": 1.0,
                "fps": 8.0}  # fmt: skip
    return None


class StubServer:
    """uvicorn serving `make_app` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, api_key: str | None = None) -> None:
        self.state = StubState()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(make_app(self.state, api_key), log_level="critical", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> StubServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("stub server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()
