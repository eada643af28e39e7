"""Slow, vanishing and greedy clients cost nothing but themselves (real engine, tiny model, real socket):
a WebSocket that never reads is dropped and its requests aborted while another client is served
unchanged; clients that vanish at random points leave zero requests, KV blocks and encoder references;
per-key concurrency, header and body caps, idle timeouts; CORS off by default; secrets and surfaces."""

from __future__ import annotations

import ast
import asyncio
import base64
import contextlib
import hmac
import json
import random
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from mmserve.api import ServerSettings, create_app
from mmserve.api import app as app_module
from mmserve.api.server import ServerThread
from mmserve.config import EngineArgs
from mmserve.engine.async_engine import AsyncEngine

ASSETS = Path(__file__).resolve().parent.parent / "assets"
KEY = "sk-test"
HELLO = [{"role": "user", "content": "Describe a red circle on a white background."}]
AUTH = {"Authorization": f"Bearer {KEY}"}


def body(max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": HELLO,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def image_body(max_tokens: int) -> dict[str, Any]:
    url = "data:image/jpeg;base64," + base64.b64encode((ASSETS / "sample.jpg").read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    return body(max_tokens, messages=[{"role": "user", "content": content}])


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Callable[[str], Path]) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(
        EngineArgs(
            str(tiny_model_dir("qwen2_vl")), max_num_batched_tokens=128, max_model_len=2048, num_kv_blocks=256
        )
    )
    yield engine
    asyncio.run(engine.shutdown(1.0))


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> ServerSettings:
    return ServerSettings(
        api_key=KEY,
        data_dir=tmp_path_factory.mktemp("data") / "private",
        served_model_name="tiny",
        ws_send_queue_events=32,
        ws_send_timeout_s=2.0,
        max_header_bytes=8192,
        max_body_bytes=2_000_000,
        keep_alive_timeout_s=1,
        ws_idle_timeout_s=1.0,
    )


@pytest.fixture(scope="module")
def server(engine: AsyncEngine, settings: ServerSettings) -> Iterator[ServerThread]:
    live = ServerThread(lambda: create_app(engine, settings))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


def assert_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Zero requests in flight, every KV block free, no encoder-cache entry referenced."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        idle = (
            engine.num_in_flight == 0
            and stats.num_running == 0
            and stats.num_waiting == 0
            and stats.num_free_blocks == stats.num_total_blocks
            and stats.num_referenced_encoder_tokens == 0
        )
        if idle:
            return
        assert time.monotonic() < deadline, (engine.num_in_flight, stats)
        time.sleep(0.05)


def ws_text(server: ServerThread, response: dict[str, Any]) -> str:
    with connect(server.ws_url, additional_headers=AUTH) as ws:
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        ws.send(json.dumps({"type": "response.create", "response": response}))
        text = ""
        while True:
            event = json.loads(ws.recv(timeout=60))
            if event["type"] == "response.output_text.delta":
                text += event["delta"]
            elif event["type"] == "response.done":
                assert event["response"]["status"] == "incomplete", event
                return text
            elif event["type"] == "error":
                raise AssertionError(event)


def test_websocket_that_never_reads_is_dropped_without_slowing_others(
    engine: AsyncEngine, server: ServerThread, settings: ServerSettings
) -> None:
    reference = ws_text(server, body(40))
    app = create_app(engine, settings)  # driven over ASGI directly: its transport never takes a frame
    stalled = threading.Event()

    async def never_reading_client() -> None:
        events = [json.dumps({"type": "response.create", "response": body(400)}) for _ in range(3)]
        inbox: list[dict[str, Any]] = [{"type": "websocket.connect"}]
        inbox += [{"type": "websocket.receive", "text": e} for e in events]
        forever = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if inbox:
                return inbox.pop(0)
            await forever.wait()  # the client says nothing more and never hangs up
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "websocket.accept":
                return
            stalled.set()
            await forever.wait()  # the client's receive window is full: no frame ever leaves

        scope = {
            "type": "websocket", "path": "/v1/chat/ws", "raw_path": b"/v1/chat/ws", "query_string": b"",
            "headers": [(b"authorization", f"Bearer {KEY}".encode())], "scheme": "ws", "subprotocols": [],
            "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2), "root_path": "", "app": app,
        }  # fmt: skip
        await asyncio.wait_for(app(scope, receive, send), timeout=60)  # the server gives up on it

    dropped = threading.Thread(target=asyncio.run, args=(never_reading_client(),))
    dropped.start()
    assert stalled.wait(30)
    # Meanwhile another socket is served, with the same text as before.
    assert ws_text(server, body(40)) == reference
    dropped.join(timeout=60)
    assert not dropped.is_alive()
    assert_idle(engine)  # its three responses were aborted


def test_clients_that_vanish_at_random_points_leave_nothing_behind(
    engine: AsyncEngine, server: ServerThread
) -> None:
    rng = random.Random(0)

    def ws_vanish(after: int, media: bool) -> None:
        with connect(server.ws_url, additional_headers=AUTH) as ws:
            ws.recv(timeout=30)
            for _ in range(2):
                ws.send(
                    json.dumps(
                        {"type": "response.create", "response": image_body(300) if media else body(300)}
                    )
                )
            for _ in range(after):
                ws.recv(timeout=60)
        # leaving the block closes the socket mid-stream

    def sse_abandon(after: int, media: bool) -> None:
        with (
            httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client,
            client.stream("POST", "/v1/chat/completions", json={**(image_body(300) if media else body(300)),
                                                                 "stream": True}) as r,
        ):  # fmt: skip
            lines = r.iter_lines()
            for _ in range(after):
                next(lines)

    def plain_timeout(after: int, media: bool) -> None:
        with (
            httpx.Client(base_url=server.url, headers=AUTH, timeout=0.05 * after + 0.2) as client,
            contextlib.suppress(httpx.TimeoutException),
        ):
            client.post("/v1/chat/completions", json=image_body(300) if media else body(300))

    def ws_raw_reset(after: int, media: bool) -> None:
        with connect(server.ws_url, additional_headers=AUTH) as ws:
            ws.recv(timeout=30)
            ws.send(
                json.dumps({"type": "response.create", "response": image_body(300) if media else body(300)})
            )
            for _ in range(after):
                ws.recv(timeout=60)
            ws.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            ws.socket.close()  # an RST, no close frame

    kinds = [ws_vanish, sse_abandon, plain_timeout, ws_raw_reset]
    failures: list[BaseException] = []

    def run(kind: Callable[[int, bool], None], after: int, media: bool) -> None:
        try:
            kind(after, media)
        except BaseException as exc:  # reported below: a client's own error must fail the test
            failures.append(exc)

    threads = [
        threading.Thread(target=run, args=(kinds[i % 4], rng.randint(1, 12), rng.random() < 0.4))
        for i in range(12)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures
    assert_idle(engine, timeout=20)
    # Every embedding the runner still holds is an unreferenced cache entry the scheduler knows of,
    # and the runner keeps no request's plan state.
    report = engine.call_utility("leak_report")
    assert not any(report.values()), report


def test_per_key_concurrency_limit_is_429_with_retry_after(
    engine: AsyncEngine, settings: ServerSettings
) -> None:
    limited = settings.model_copy(update={"max_concurrent_requests_per_key": 4})
    server = ServerThread(lambda: create_app(engine, limited))
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=60)
    sockets = []
    try:
        for _ in range(4):  # the key's 4 slots, held by long WebSocket responses
            ws = connect(server.ws_url, additional_headers=AUTH).__enter__()
            ws.recv(timeout=30)
            ws.send(json.dumps({"type": "response.create", "response": body(1500)}))
            assert json.loads(ws.recv(timeout=30))["type"] == "response.created"
            sockets.append(ws)
        refused = http.post("/v1/chat/completions", json=body())
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "too_many_concurrent_requests"
        ws = sockets[0]
        ws.send(json.dumps({"type": "response.create", "response": {"id": "fifth", **body()}}))
        events = []
        while not (
            events and events[-1]["type"] == "response.done" and events[-1]["response"]["id"] == "fifth"
        ):
            event = json.loads(ws.recv(timeout=30))
            if event.get("response_id") == "fifth" or event.get("response", {}).get("id") == "fifth":
                events.append(event)
        assert [e["type"] for e in events] == ["error", "response.done"]
        assert events[0]["error"]["code"] == "too_many_concurrent_requests"
        for ws in sockets:
            ws.close()
        deadline = time.monotonic() + 10
        while http.post("/v1/chat/completions", json=body()).status_code == 429:  # slots come back
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        for ws in sockets:
            ws.close()
        http.close()
        server.stop()
    assert_idle(engine)


def test_header_and_body_caps_and_idle_timeouts(server: ServerThread, http: httpx.Client) -> None:
    huge = http.get("/v1/models", headers={"X-Filler": "a" * 20_000})
    assert huge.status_code == 431 and huge.json()["error"]["code"] == "headers_too_large"
    too_big = http.post(
        "/v1/chat/completions",
        content=b"{" + b" " * 2_100_000 + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "body_too_large"
    assert http.get("/health").status_code == 200  # still serving
    # An idle keep-alive connection is closed after keep_alive_timeout_s.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while not received.endswith(b'{"status":"ok"}'):  # head and body may come in two segments
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        assert b"200 OK" in received
        start = time.monotonic()
        assert sock.recv(65536) == b""  # EOF: the server hung up
        assert time.monotonic() - start < 5
    # An idle WebSocket (no message, no response in progress) is closed after ws_idle_timeout_s.
    with connect(server.ws_url, additional_headers=AUTH) as ws:
        ws.recv(timeout=10)
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=5)


def test_cors_is_off_unless_configured(engine: AsyncEngine, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    off = TestClient(create_app(engine, ServerSettings(data_dir=tmp_path)))
    assert "access-control-allow-origin" not in off.options("/v1/chat/completions", headers=preflight).headers
    assert (
        "access-control-allow-origin"
        not in off.get("/health", headers={"Origin": "https://evil.example"}).headers
    )
    on = TestClient(
        create_app(engine, ServerSettings(data_dir=tmp_path, cors_allow_origins=("https://app.example",)))
    )
    ok = on.options("/v1/chat/completions", headers={**preflight, "Origin": "https://app.example"})
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in on.options("/v1/chat/completions", headers=preflight).headers


def test_api_key_comparison_is_constant_time(
    monkeypatch: pytest.MonkeyPatch, settings: ServerSettings
) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    assert not app_module.check_api_key(settings, "Bearer sk-wrong")
    assert app_module.check_api_key(settings, f"Bearer {KEY}")
    assert not app_module.check_api_key(settings, None, "sk-tesT")
    assert len(calls) == 3  # every comparison with the key went through compare_digest


def test_uploads_are_private_and_nothing_logs_prompts_or_media(
    http: httpx.Client, settings: ServerSettings, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "zebra-unicorn-7319"
    with caplog.at_level("DEBUG"):
        upload = http.post(
            "/v1/files", files={"file": ("photo.jpg", (ASSETS / "sample.jpg").read_bytes(), "image/jpeg")},
            data={"purpose": "vision"},
        )  # fmt: skip
        assert upload.status_code == 200, upload.text
        file_id = upload.json()["id"]
        content = [{"type": "image_url", "image_url": {"url": file_id}}, {"type": "text", "text": secret}]
        assert http.post(
            "/v1/chat/completions", json=body(messages=[{"role": "user", "content": content}])
        ).is_success
        image = image_body(4)
        assert http.post("/v1/chat/completions", json=image).is_success
    logged = "\n".join(r.getMessage() + str(r.args) for r in caplog.records)
    assert (
        secret not in logged and image["messages"][0]["content"][0]["image_url"]["url"][30:90] not in logged
    )
    root = settings.data_dir
    for d in (root, root / "blobs", root / "files", root / "tmp"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    stored = [p for p in (root / "blobs").iterdir()] + [p for p in (root / "files").iterdir()]
    assert stored and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in stored)


def test_nothing_from_a_client_is_unpickled() -> None:
    """No module that handles client input imports pickle / marshal / shelve or calls torch.load."""
    package = Path(__file__).resolve().parent.parent / "mmserve"
    banned = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle"}
    for path in [*package.glob("api/*.py"), *package.glob("encoders/*.py"), *package.glob("client/*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & banned, path
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned, path
            elif isinstance(node, ast.Attribute) and node.attr == "load":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "torch"), path


def test_api_keys_in_websocket_urls_are_redacted_from_uvicorn_logs() -> None:
    import logging

    from mmserve.api import log_safety

    log_safety.install()
    record = logging.LogRecord(
        "uvicorn.error", logging.INFO, __file__, 0, '%s - "WebSocket %s" [accepted]',
        ("127.0.0.1:5000", "/v1/chat/ws?x=1&api_key=sk-secret-42&y=2"), None,
    )  # fmt: skip
    for f in logging.getLogger("uvicorn.error").filters:
        f.filter(record)
    assert record.getMessage() == '127.0.0.1:5000 - "WebSocket /v1/chat/ws?x=1&api_key=***&y=2" [accepted]'
