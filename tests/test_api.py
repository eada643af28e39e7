"""The HTTP / WebSocket server against a real engine on the tiny model, over a real uvicorn socket:
greedy text agrees across JSON, SSE, WebSocket and the offline LLM; the stock `openai` package works;
WebSocket cancel / close free memory; uploads are validated by content; errors have OpenAI's shape."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image
from websockets.exceptions import InvalidStatus
from websockets.sync.client import ClientConnection, connect

from mmserve import LLM, SamplingParams
from mmserve.api import ServerSettings, create_app
from mmserve.api.server import ServerThread
from mmserve.config import EngineArgs
from mmserve.encoders.media import MediaLimits
from mmserve.engine.async_engine import AsyncEngine

ASSETS = Path(__file__).resolve().parent.parent / "assets"
KEY = "sk-test"
MAX_TOKENS = 10
HELLO = [{"role": "user", "content": "Describe a red circle on a white background."}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen2_vl")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(
        EngineArgs(str(model_dir), max_num_batched_tokens=128, max_model_len=2048, num_kv_blocks=256),
        media_limits=MediaLimits(max_items_per_prompt=2),
    )
    yield engine
    asyncio.run(engine.shutdown(1.0))


@pytest.fixture(scope="module")
def server(engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = ServerSettings(
        api_key=KEY,
        data_dir=tmp_path_factory.mktemp("mmserve-data"),
        served_model_name="tiny",
        allowed_media_domains=("localhost",),  # it resolves to loopback: refused without the opt-in
        max_ws_message_bytes=200_000,
        max_image_upload_bytes=100_000,  # sample.jpg is 48 KB
        max_video_upload_bytes=1_000_000,
    )
    live = ServerThread(lambda: create_app(engine, settings))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def greedy(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def sse_events(client: httpx.Client, body: dict[str, Any]) -> list[Any]:
    events = []
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def ws_recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=60))


@contextmanager
def ws_connect(server: ServerThread) -> Iterator[ClientConnection]:
    with connect(server.ws_url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert ws_recv(ws)["type"] == "session.created"
        yield ws


def ws_run(ws: ClientConnection, response: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    ws.send(json.dumps({"type": "response.create", "response": response}))
    text = ""
    while True:
        event = ws_recv(ws)
        if event["type"] == "response.output_text.delta":
            text += event["delta"]
        elif event["type"] == "response.done":
            return text, event["response"]
        elif event["type"] == "error":
            raise AssertionError(event)


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"mmserve:{name}{{") or line.startswith(f"mmserve:{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_idle(http: httpx.Client) -> str:
    deadline = time.monotonic() + 10
    while True:
        text = http.get("/metrics").text
        if metric(text, "num_requests_running") == 0 and metric(text, "kv_cache_usage_perc") == 0:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(text)
        time.sleep(0.05)


def tokens_of(usage: dict[str, Any]) -> dict[str, Any]:
    """Usage without `prompt_tokens_details` (a repeated prompt's cached tokens differ from the first's)."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code, error
    return error


# ------------------------------------------------------------------------------------------ chat


def test_greedy_text_agrees_across_json_sse_websocket_and_offline(
    server: ServerThread, http: httpx.Client, model_dir: Path
) -> None:
    response = http.post("/v1/chat/completions", json=greedy(messages=HELLO))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + MAX_TOKENS
    json_text = body["choices"][0]["message"]["content"]

    events = sse_events(http, greedy(messages=HELLO, stream=True, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and tokens_of(chunks[-1]["usage"]) == tokens_of(body["usage"])
    content = chunks[1:-1]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (len(content) - 1) + ["length"]
    sse_text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)

    with ws_connect(server) as ws:
        ws_text, done = ws_run(ws, {"messages": HELLO, "max_tokens": MAX_TOKENS, "temperature": 0,
                                    "ignore_eos": True})  # fmt: skip
    assert done["status"] == "incomplete" and done["finish_reason"] == "length"
    assert done["output_text"] == ws_text and tokens_of(done["usage"]) == tokens_of(body["usage"])
    assert done["metrics"]["ttft_ms"] > 0 and done["metrics"]["tokens_per_s"] > 0

    offline = LLM(model_dir, max_num_batched_tokens=128, max_model_len=2048, num_kv_blocks=256).chat(
        HELLO, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )[0]
    assert json_text == sse_text == ws_text == offline.text
    assert json_text  # the tiny model's noise is still some text


def test_openai_package_text_image_stream_logprobs_and_errors(oai: openai.OpenAI) -> None:
    extra = {"ignore_eos": True}
    done = oai.chat.completions.create(model="tiny", messages=HELLO, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body=extra)  # fmt: skip
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5
    tokens = done.choices[0].logprobs.content
    assert len(tokens) == 5 and all(len(t.top_logprobs) == 3 for t in tokens)
    assert "".join(t.token for t in tokens) == done.choices[0].message.content
    assert all(t.logprob == t.top_logprobs[0].logprob for t in tokens)  # greedy picks the most likely

    image = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(ASSETS / "sample.jpg", "image/jpeg")}},
        {"type": "text", "text": "What is in this photo?"},
    ]}]  # fmt: skip
    with_image = oai.chat.completions.create(model="tiny", messages=image, max_tokens=4, temperature=0,
                                             extra_body=extra)  # fmt: skip
    assert with_image.usage.prompt_tokens > done.usage.prompt_tokens + 4  # the image's embedding tokens

    stream = oai.chat.completions.create(model="tiny", messages=HELLO, max_tokens=5, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body=extra)  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5

    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * 3000}])
    assert info.value.code == "prompt_too_long"
    with pytest.raises(openai.UnprocessableEntityError):
        oai.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(oai.base_url), api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in oai.models.list()] == ["tiny"]


# ------------------------------------------------------------------------------------------ WebSocket


def test_websocket_interleaved_responses_cancel_and_close(server: ServerThread, http: httpx.Client) -> None:
    long = {"messages": HELLO, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    short = {"messages": HELLO, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with ws_connect(server) as ws:
        ws.send(json.dumps({"type": "response.create", "response": {"id": "a", **long}}))
        ws.send(json.dumps({"type": "response.create", "response": {"id": "b", **short}}))
        deltas: dict[str, str] = {"a": "", "b": ""}
        done: dict[str, dict[str, Any]] = {}
        created = set()
        cancelled = False
        while len(done) < 2:
            event = ws_recv(ws)
            if event["type"] == "response.created":
                assert event["response"]["status"] == "in_progress"
                created.add(event["response"]["id"])
            elif event["type"] == "response.output_text.delta":
                deltas[event["response_id"]] += event["delta"]
                if event["response_id"] == "a" and deltas["b"] and not cancelled:
                    ws.send(json.dumps({"type": "response.cancel", "response_id": "a"}))
                    cancelled = True
            elif event["type"] == "response.done":
                done[event["response"]["id"]] = event["response"]
            else:
                raise AssertionError(event)
        assert created == {"a", "b"}
        assert done["a"]["status"] == "cancelled" and done["a"]["usage"]["completion_tokens"] < 400
        assert done["b"]["status"] == "incomplete" and done["b"]["usage"]["completion_tokens"] == 12
        assert done["b"]["output_text"] == deltas["b"]

        # Cancelled in the same breath as created: the response still ends, as cancelled.
        ws.send(json.dumps({"type": "response.create", "response": {"id": "c", **long}}))
        ws.send(json.dumps({"type": "response.cancel", "response_id": "c"}))
        events = [ws_recv(ws)]
        while events[-1]["type"] != "response.done":
            events.append(ws_recv(ws))
        # A first delta may come before the cancel is read (the engine core runs beside the server).
        assert {e["type"] for e in events[1:-1]} <= {"response.output_text.delta"}
        assert events[0]["type"] == "response.created" and events[-1]["response"]["status"] == "cancelled"

        # Bad events are non-fatal: an error event, then the socket still serves.
        ws.send(json.dumps({"type": "response.create", "response": {"messages": [{"role": "user",
                            "content": "x" * 300_000}]}}))  # fmt: skip
        assert ws_recv(ws)["error"]["code"] == "message_too_large"
        ws.send("not json")
        assert ws_recv(ws)["error"]["code"] == "invalid_json"
        ws.send(json.dumps({"type": "response.cancel", "response_id": "nope", "event_id": "e1"}))
        error = ws_recv(ws)
        assert error["type"] == "error" and error["event_id"] == "e1"
        ws.send(json.dumps({"type": "response.create", "event_id": "e2",
                            "response": {"messages": [{"role": "user", "content": "x " * 3000}]}}))  # fmt: skip
        events = [ws_recv(ws) for _ in range(3)]
        assert [e["type"] for e in events] == ["response.created", "error", "response.done"]
        assert events[1]["error"]["code"] == "prompt_too_long" and events[1]["event_id"] == "e2"
        assert events[2]["response"]["status"] == "failed"
        ws.send(json.dumps({"type": "response.create", "response": {**short, "kv_transfer_params": {
                            "do_remote_prefill": True}}}))  # fmt: skip
        events = [ws_recv(ws) for _ in range(3)]
        assert events[1]["error"]["param"] == "kv_transfer_params" and events[2]["response"]["status"] == "failed"
        text, final = ws_run(ws, short)
        assert final["status"] == "incomplete" and text == deltas["b"]

    # Close mid-stream: every response of the socket is aborted and its KV blocks freed.
    with ws_connect(server) as ws:
        ws.send(json.dumps({"type": "response.create", "response": long}))
        ws.send(json.dumps({"type": "response.create", "response": long}))
        deltas_seen = 0
        while deltas_seen < 4:
            deltas_seen += ws_recv(ws)["type"] == "response.output_text.delta"
        assert metric(http.get("/metrics").text, "num_requests_running") >= 1
    text = wait_idle(http)
    assert metric(text, "num_requests_waiting") == 0
    assert 'mmserve:request_success_total{finished_reason="abort",model_name="tiny"}' in text


def test_websocket_auth(server: ServerThread) -> None:
    with pytest.raises(InvalidStatus, match="401"), connect(server.ws_url):
        pass
    with connect(server.ws_url + f"?api_key={KEY}") as ws:
        assert ws_recv(ws)["type"] == "session.created"


# ------------------------------------------------------------------------------------------ uploads


def png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def upload(
    http: httpx.Client, name: str, data: bytes, mime: str = "application/octet-stream"
) -> httpx.Response:
    return http.post("/v1/files", files={"file": (name, data, mime)}, data={"purpose": "vision"})


def test_upload_photo_and_clip_then_chat_by_id(http: httpx.Client) -> None:
    photo = upload(http, "../../etc/photo.jpg", (ASSETS / "sample.jpg").read_bytes(), "image/jpeg")
    assert photo.status_code == 200, photo.text
    p = photo.json()
    with Image.open(ASSETS / "sample.jpg") as img:
        assert (p["width"], p["height"]) == img.size
    assert p["object"] == "file" and p["media_type"] == "image" and p["filename"] == "photo.jpg"
    assert p["id"].startswith("file-") and p["bytes"] == (ASSETS / "sample.jpg").stat().st_size

    clip = upload(http, "clip.bin", (ASSETS / "sample_clip.mp4").read_bytes())
    assert clip.status_code == 200, clip.text
    c = clip.json()
    assert c["media_type"] == "video" and c["num_frames"] >= 1 and c["duration_s"] > 0 and c["fps"] > 0

    assert http.get(f"/v1/files/{p['id']}").json() == p
    assert {f["id"] for f in http.get("/v1/files").json()["data"]} >= {p["id"], c["id"]}
    assert http.get(f"/v1/files/{c['id']}/content").content == (ASSETS / "sample_clip.mp4").read_bytes()

    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": p["id"]}},
        {"type": "file", "file": {"file_id": c["id"]}},
        {"type": "text", "text": "Compare them."},
    ]}]  # fmt: skip
    by_id = http.post("/v1/chat/completions", json=greedy(messages=messages, max_tokens=3))
    assert by_id.status_code == 200, by_id.text
    inline = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(ASSETS / "sample.jpg", "image/jpeg")}},
        {"type": "video_url", "video_url": {"url": data_url(ASSETS / "sample_clip.mp4", "video/mp4")}},
        {"type": "text", "text": "Compare them."},
    ]}]  # fmt: skip
    same = http.post("/v1/chat/completions", json=greedy(messages=inline, max_tokens=3)).json()
    assert by_id.json()["choices"][0]["message"] == same["choices"][0]["message"]
    assert tokens_of(by_id.json()["usage"]) == tokens_of(same["usage"])

    wrong_kind = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": p["id"]}}]}]
    assert_error(http.post("/v1/chat/completions", json=greedy(messages=wrong_kind)), 400)

    assert http.delete(f"/v1/files/{p['id']}").json() == {"id": p["id"], "object": "file", "deleted": True}
    assert_error(http.get(f"/v1/files/{p['id']}"), 404, "file_not_found")
    assert_error(http.delete(f"/v1/files/{p['id']}"), 404)
    gone = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": p["id"]}}]}]
    assert_error(http.post("/v1/chat/completions", json=greedy(messages=gone)), 400, "file_not_found")


def _jpeg(size: tuple[int, int] = (64, 48)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format="JPEG")
    return buf.getvalue()


def _noise_png(side: int) -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", (side, side), random.Random(0).randbytes(side * side * 3)).save(buf, "PNG")
    return buf.getvalue()


BAD_UPLOADS = {
    "corrupt_png": ("x.png", _noise_png(16)[:40] + b"\x00" * 200, 400, None),
    "truncated_jpeg": ("x.jpg", _jpeg((256, 256))[:400], 400, None),
    "decompression_bomb": ("bomb.png", png_header_only(30000, 30000), 400, "image_too_large"),
    "text_named_mp4": (
        "movie.mp4",
        b"this is not a video, just some text\n" * 10,
        415,
        "unsupported_media_type",
    ),
    "empty": ("empty.jpg", b"", 400, "empty_file"),
    "oversized_image": ("big.png", _noise_png(256), 413, "image_too_large"),  # ~197 KB > 100 KB
}


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_uploads_are_refused_and_the_server_keeps_serving(http: httpx.Client, case: str) -> None:
    name, data, status, code = BAD_UPLOADS[case]
    error = assert_error(upload(http, name, data), status, code)
    assert "Traceback" not in error["message"] and "PIL" not in error["message"]
    assert http.get("/health").status_code == 200


def test_upload_limits_and_missing_field(http: httpx.Client) -> None:
    assert_error(http.post("/v1/files", data={"purpose": "vision"}), 400, "missing_file")
    big = b"\x00" * 3_000_000  # over the whole upload cap: refused from Content-Length, never stored
    assert_error(upload(http, "big.mp4", big), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the cap is enforced while counting
        yield b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.mp4"\r\n\r\n'
        for _ in range(4):
            yield b"\x00" * 1_000_000

    headers = {"content-type": "multipart/form-data; boundary=xyz"}
    assert_error(http.post("/v1/files", content=chunked(), headers=headers), 413, "body_too_large")
    assert http.get("/health").status_code == 200


# ------------------------------------------------------------------------------------------ errors


def test_errors_have_openai_shape_and_status(server: ServerThread, http: httpx.Client) -> None:
    assert httpx.get(server.url + "/health").status_code == 200  # open without the key
    assert_error(httpx.get(server.url + "/v1/models"), 401, "invalid_api_key")
    assert_error(httpx.get(server.url + "/v1/files", headers={"Authorization": "Bearer nope"}), 401)
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(
        http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
        400,
    )
    err = assert_error(http.post("/v1/chat/completions", json={"messages": "hi"}), 422, "invalid_schema")
    assert err["param"].startswith("messages")
    assert_error(http.post("/v1/chat/completions", json=greedy(messages=HELLO, temperature="hot")), 422)
    assert_error(http.post("/v1/chat/completions", json=greedy(messages=HELLO, n=1000)), 400)
    long = [{"role": "user", "content": "hello " * 3000}]
    assert_error(http.post("/v1/chat/completions", json=greedy(messages=long)), 400, "prompt_too_long")
    url = data_url(ASSETS / "sample.jpg", "image/jpeg")
    three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}] * 3}]
    assert_error(http.post("/v1/chat/completions", json=greedy(messages=three)), 400, "too_many_images")
    bad_image = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
        }
    ]
    err = assert_error(http.post("/v1/chat/completions", json=greedy(messages=bad_image)), 400)
    assert err["message"].startswith("image 0:")
    for url, code in [
        ("https://example.com/a.jpg", "remote_media_disabled"),
        ("/etc/passwd", "local_media_disabled"),
    ]:
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        assert_error(http.post("/v1/chat/completions", json=greedy(messages=msgs)), 400, code)
    # The stream's errors before its first byte are HTTP errors too.
    assert_error(
        http.post("/v1/chat/completions", json=greedy(messages=long, stream=True)), 400, "prompt_too_long"
    )
    assert_error(http.post("/v1/chat/completions", content=b"x" * (65 * 2**20)), 413, "body_too_large")
    assert http.post("/v1/chat/completions", json=greedy(messages=HELLO, max_tokens=2)).status_code == 200


def test_queue_full_is_429_with_retry_after(model_dir: Path, tmp_path: Path) -> None:
    engine = AsyncEngine(EngineArgs(str(model_dir), num_kv_blocks=64), max_waiting_requests=0)
    live = ServerThread(
        lambda: create_app(engine, ServerSettings(data_dir=tmp_path, served_model_name="tiny"))
    )
    try:
        response = httpx.post(live.url + "/v1/chat/completions", json=greedy(messages=HELLO), timeout=30)
        assert_error(response, 429, "queue_full")
        assert int(response.headers["Retry-After"]) >= 1
        assert httpx.get(live.url + "/health").status_code == 200
    finally:
        live.stop()
        asyncio.run(engine.shutdown(1.0))


def aborted(text: str) -> float:
    prefix = 'mmserve:request_success_total{finished_reason="abort",model_name="tiny"} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


def test_client_disconnect_aborts_streaming_and_plain_requests(http: httpx.Client) -> None:
    body = greedy(messages=HELLO, max_tokens=2000)
    before = aborted(http.get("/metrics").text)
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines, strict=False) if line.startswith("data: ")) >= 3
    # Leaving the block closed the connection mid-stream.
    assert aborted(wait_idle(http)) == before + 1
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 10
    while aborted(http.get("/metrics").text) < before + 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    wait_idle(http)


class _MediaHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/sample.jpg":
            data = (ASSETS / "sample.jpg").read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", self.path.split("?to=", 1)[1])
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


def test_remote_media_urls_allow_list_private_addresses_and_redirects(
    engine: AsyncEngine, http: httpx.Client, tmp_path: Path
) -> None:
    media = ThreadingHTTPServer(("127.0.0.1", 0), _MediaHandler)
    threading.Thread(target=media.serve_forever, daemon=True).start()
    port = media.server_address[1]
    settings = ServerSettings(
        served_model_name="tiny",
        data_dir=tmp_path,
        allowed_media_domains=("localhost",),
        allow_private_media_addresses=True,
    )
    live = ServerThread(lambda: create_app(engine, settings))

    def chat(client: httpx.Client, base: str, url: str) -> httpx.Response:
        msgs = [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}],
            }
        ]
        return client.post(base + "/v1/chat/completions", json=greedy(messages=msgs, max_tokens=3))

    try:
        good = f"http://localhost:{port}/sample.jpg"
        assert_error(chat(http, "", good), 400, "remote_media_forbidden")  # loopback, no opt-in
        with httpx.Client(timeout=60) as client:
            fetched = chat(client, live.url, good)
            assert fetched.status_code == 200, fetched.text
            inline = chat(client, live.url, data_url(ASSETS / "sample.jpg", "image/jpeg")).json()
            assert fetched.json()["choices"][0]["message"] == inline["choices"][0]["message"]
            ok_hop = f"http://localhost:{port}/redirect?to={good}"
            assert chat(client, live.url, ok_hop).status_code == 200
            bad_hop = f"http://localhost:{port}/redirect?to=http://127.0.0.1:{port}/sample.jpg"
            assert_error(chat(client, live.url, bad_hop), 400, "remote_media_disabled")
            assert_error(
                chat(client, live.url, f"http://localhost:{port}/missing.jpg"), 400, "remote_media_error"
            )
            assert_error(
                chat(client, live.url, f"http://127.0.0.1:{port}/sample.jpg"), 400, "remote_media_disabled"
            )
    finally:
        live.stop()
        media.shutdown()


def test_ttft_counts_from_receipt_media_decoding_included(server: ServerThread, http: httpx.Client) -> None:
    """TTFT and e2e start when the route receives the request, before its image is fetched and decoded;
    the preprocessing has its own histogram; the engine-core process reports its loop times."""
    rng = random.Random(0)
    image = Image.frombytes("RGB", (1280, 960), bytes(rng.getrandbits(8) for _ in range(1280 * 960 * 3)))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=95)
    url = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    before = http.get("/metrics").text
    response = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "ignore_eos": True,
                                                        "messages": [{"role": "user", "content": content}]})  # fmt: skip
    assert response.status_code == 200, response.text
    after = wait_idle(http)

    def value(text: str, name: str) -> float:  # a labelled histogram appears at its first observation
        return metric(text, name) if f"mmserve:{name}{{" in text else 0.0

    d = {name: value(after, name) - value(before, name) for name in (
        "request_preprocess_time_seconds_count", "request_preprocess_time_seconds_sum",
        "time_to_first_token_seconds_sum", "e2e_request_latency_seconds_sum")}  # fmt: skip
    assert d["request_preprocess_time_seconds_count"] == 1
    assert d["request_preprocess_time_seconds_sum"] > 0.005  # a 1.2-megapixel JPEG's decode, at least
    assert d["time_to_first_token_seconds_sum"] > d["request_preprocess_time_seconds_sum"]
    assert d["e2e_request_latency_seconds_sum"] >= d["time_to_first_token_seconds_sum"]
    assert 'mmserve:engine_core_loop_seconds_total{model_name="tiny",part="step"}' in after
