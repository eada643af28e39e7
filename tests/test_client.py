"""Unit tests of the Python SDK (`mmserve.client`) against the protocol stub in client_protocol_stub.py.

The stub is a real HTTP/WebSocket server on a free local port with canned answers (no engine), so these
tests check the SDK's own behaviour: typing, streaming, errors, retries, sessions, files, media helpers.
"""

from __future__ import annotations

import base64
import io
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_protocol_stub import WORDS, StubServer
from PIL import Image

import mmserve.client._base as base
from mmserve.client import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    ChatCompletion,
    Client,
    InternalServerError,
    NotFoundError,
    RateLimitError,
    RequestTooLargeError,
    UnprocessableEntityError,
    UnsupportedMediaTypeError,
    avideo_part,
    image_part,
    video_part,
)

TEXT = "".join(WORDS)
MP4_HEAD = b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64  # enough for the stub's sniffing


def _msg(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _png(size: tuple[int, int] = (7, 5)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (255, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def stub() -> Iterator[StubServer]:
    server = StubServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_stub() -> Iterator[StubServer]:
    server = StubServer(api_key="sekrit").start()
    yield server
    server.stop()


@pytest.fixture
def client(stub: StubServer) -> Iterator[Client]:
    with Client(stub.url, max_retries=2) as c:
        yield c


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Record retry back-off delays instead of sleeping."""
    recorded: list[float] = []

    async def asleep(s: float) -> None:
        recorded.append(s)

    monkeypatch.setattr(base, "_sleep", recorded.append)
    monkeypatch.setattr(base, "_asleep", asleep)
    return recorded


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MMSERVE_API_KEY", raising=False)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ------------------------------------------------------------------------------------------- chat


def test_chat_json_typed_and_params_sent(client: Client, stub: StubServer) -> None:
    out = client.chat.completions.create(
        messages=_msg("hi"), max_tokens=8, temperature=0.0, top_k=3, seed=1, stop=["\n"], ignore_eos=True,
        priority=2, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    assert isinstance(out, ChatCompletion)
    assert out.choices[0].message.content == TEXT and out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.total_tokens == 8
    body = stub.state.last_body
    assert body is not None and "model" not in body and "stream" not in body
    assert {k: body[k] for k in ("max_tokens", "top_k", "seed", "stop", "ignore_eos", "priority")} == {
        "max_tokens": 8, "top_k": 3, "seed": 1, "stop": ["\n"], "ignore_eos": True, "priority": 2,
    }  # fmt: skip


def test_unknown_parameter_is_a_type_error(client: Client) -> None:
    with pytest.raises(TypeError, match="max_new_tokens"):
        client.chat.completions.create(messages=_msg("hi"), max_new_tokens=3)  # type: ignore[call-overload]


def test_base_url_with_v1_suffix(stub: StubServer) -> None:
    with Client(stub.url + "/v1/") as c:
        assert c.models.list().data[0].id == "stub-model"
        assert c.health() == {"status": "ok"}


def test_stream_chunks_usage_and_final_text(client: Client) -> None:
    with client.chat.completions.create(
        messages=_msg("hi"), stream=True, stream_options={"include_usage": True}
    ) as stream:
        chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
    assert stream.completed and stream.text == TEXT and stream.finish_reason == "stop"
    assert stream.usage is not None and stream.usage.completion_tokens == len(WORDS)
    assert stream.request_id == "req_sse" and stream.response.is_closed


def test_text_stream_then_get_final_text(client: Client) -> None:
    stream = client.chat.completions.create(messages=_msg("hi"), stream=True)
    first = next(iter(stream.text_stream))
    assert first == WORDS[0]
    assert stream.get_final_text() == TEXT  # includes the part already read
    assert stream.response.is_closed


def test_stream_closes_on_break(client: Client, stub: StubServer) -> None:
    with client.chat.completions.create(messages=_msg("stream-long"), stream=True) as stream:
        for _ in stream.text_stream:
            break
    assert stream.response.is_closed
    assert stub.state.stream_closed_early.wait(5.0), "server never saw the client leave"


def test_in_stream_error_raises(client: Client) -> None:
    stream = client.chat.completions.create(messages=_msg("stream-error"), stream=True)
    with stream, pytest.raises(APIError) as info:
        stream.get_final_text()
    assert info.value.code == "engine_error" and info.value.message == "engine failed"
    assert stream.text == "".join(WORDS[:2]) and stream.response.is_closed


def test_no_retry_once_stream_yielded(client: Client, stub: StubServer, sleeps: list[float]) -> None:
    stream = client.chat.completions.create(messages=_msg("stream-drop"), stream=True)
    with pytest.raises(APIConnectionError, match=r"\[DONE\]"):
        for _ in stream:
            pass
    assert stub.state.attempts["stream-drop"] == 1 and sleeps == []


# ----------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("status", "cls"),
    [(400, BadRequestError), (401, AuthenticationError), (404, NotFoundError), (413, RequestTooLargeError),
     (415, UnsupportedMediaTypeError), (422, UnprocessableEntityError), (429, RateLimitError),
     (500, InternalServerError), (503, InternalServerError)],
)  # fmt: skip
def test_error_classes(stub: StubServer, sleeps: list[float], status: int, cls: type[APIStatusError]) -> None:
    with Client(stub.url, max_retries=0) as c, pytest.raises(cls) as info:
        c.chat.completions.create(messages=_msg(f"error:{status}:code_{status}"))
    err = info.value
    assert err.status_code == status and err.code == f"code_{status}"
    assert err.message == f"stub error {status}" and err.request_id == f"req_{status}"
    assert err.type == ("invalid_request_error" if status < 500 else "server_error")
    assert (err.retry_after == 2.0) == (status in (429, 503))
    assert sleeps == []


def test_retry_after_503_then_success(client: Client, stub: StubServer, sleeps: list[float]) -> None:
    out = client.chat.completions.create(messages=_msg("flaky503:sync"))
    assert out.choices[0].message.content == TEXT
    assert stub.state.attempts["flaky503:sync"] == 2 and sleeps == [2.0]  # Retry-After honoured


def test_stream_request_is_retried_before_it_yields(
    client: Client, stub: StubServer, sleeps: list[float]
) -> None:
    with client.chat.completions.create(messages=_msg("flaky503:stream"), stream=True) as stream:
        assert stream.get_final_text() == TEXT
    assert stub.state.attempts["flaky503:stream"] == 2 and sleeps == [2.0]


def test_retries_stop_at_max_retries(client: Client, stub: StubServer, sleeps: list[float]) -> None:
    with pytest.raises(RateLimitError):
        client.chat.completions.create(messages=_msg("error:429:queue_full"))
    assert stub.state.attempts["error:429:queue_full"] == 3 and sleeps == [2.0, 2.0]
    with pytest.raises(BadRequestError):  # 4xx other than 408/429: never retried
        client.chat.completions.create(messages=_msg("error:400:bad_once"))
    assert stub.state.attempts["error:400:bad_once"] == 1
    # Admission control's refusal: retried while the server names a time, never when it names none.
    with pytest.raises(RateLimitError) as later:
        client.chat.completions.create(messages=_msg("error:429:slo_infeasible"))
    assert later.value.code == "slo_infeasible" and stub.state.attempts["error:429:slo_infeasible"] == 3
    with pytest.raises(RateLimitError) as never:
        client.chat.completions.create(messages=_msg("error:429:slo_infeasible:never"))
    assert never.value.retry_after is None and stub.state.attempts["error:429:slo_infeasible:never"] == 1


def test_backoff_is_capped_and_jittered() -> None:
    assert base.retry_delay(0, 3600.0) == base.MAX_RETRY_AFTER
    for attempt in range(8):
        d = base.retry_delay(attempt, None)
        expected = min(base.INITIAL_RETRY_DELAY * 2**attempt, base.MAX_RETRY_DELAY)
        assert 0.75 * expected <= d <= expected


def test_timeout(stub: StubServer) -> None:
    with Client(stub.url, timeout=0.3, max_retries=0) as c, pytest.raises(APITimeoutError):
        c.chat.completions.create(messages=_msg("slow"))


def test_connection_refused_is_retried(sleeps: list[float]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave: nothing listens there
    with Client(f"http://127.0.0.1:{port}", max_retries=2) as c, pytest.raises(APIConnectionError) as info:
        c.models.list()
    assert not isinstance(info.value, APITimeoutError) and len(sleeps) == 2
    with Client(f"http://127.0.0.1:{port}") as c, pytest.raises(APIConnectionError):
        c.chat.session().connect()


def test_auth_header(keyed_stub: StubServer) -> None:
    with Client(keyed_stub.url) as c, pytest.raises(AuthenticationError) as info:
        c.models.list()
    assert info.value.code == "invalid_api_key"
    with Client(keyed_stub.url, api_key="sekrit") as c:
        assert c.chat.completions.create(messages=_msg("hi")).choices[0].message.content == TEXT


def test_api_key_from_environment(keyed_stub: StubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_API_KEY", "sekrit")
    with Client(keyed_stub.url) as c:
        assert c.models.list().data[0].id == "stub-model"


# ------------------------------------------------------------------------------------------ files


def test_files_round_trip(client: Client, tmp_path: Path) -> None:
    png = _png((7, 5))
    path = tmp_path / "red.png"
    path.write_bytes(png)
    made = [client.files.create(file=path), client.files.create(file=png),
            client.files.create(file=("x.png", png), purpose="vision")]  # fmt: skip
    assert made[0].filename == "red.png" and made[2].purpose == "vision"
    for f in made:
        assert (f.media_type, f.width, f.height, f.bytes) == ("image", 7, 5, len(png))
        assert client.files.retrieve(f.id) == f
        assert client.files.content(f.id) == png
    assert {f.id for f in made} <= {f.id for f in client.files.list().data}
    assert client.files.delete(made[0].id).deleted
    with pytest.raises(NotFoundError) as info:
        client.files.retrieve(made[0].id)
    assert info.value.code == "file_not_found"
    video = client.files.create(file=("clip.mp4", MP4_HEAD))
    assert (video.media_type, video.num_frames, video.fps) == ("video", 8, 8.0)
    with pytest.raises(UnsupportedMediaTypeError):
        client.files.create(file=("notes.mp4", b"just text"))
    with pytest.raises(RequestTooLargeError):
        client.files.create(file=b"\x00" * 100_000)


# ---------------------------------------------------------------------------------------- session


def test_session_two_responses_and_cancel(client: Client, stub: StubServer) -> None:
    with client.chat.session() as session:
        assert session.session_info is not None
        slow = session.send(_msg("ws-slow"), max_tokens=500)
        fast = session.send(_msg("hi"), temperature=0.0)
        first = next(iter(slow))
        slow.cancel()
        done = fast.wait(timeout=10)
        assert (done.status, done.output_text, fast.text) == ("completed", TEXT, TEXT)
        assert done.usage is not None and done.usage.completion_tokens == len(WORDS)
        assert done.metrics is not None and done.metrics.ttft_ms == 1.0
        cancelled = slow.wait(timeout=10)
        assert cancelled.status == "cancelled" and slow.status == "cancelled"
        assert slow.text.startswith(first) and len(slow.text) < len(TEXT) * 100
        assert "".join(fast) == TEXT  # a finished handle can be iterated again
        # An error event fails only its own response; the socket stays usable.
        bad = session.send(_msg("ws-error"))
        with pytest.raises(APIError) as info:
            bad.wait(timeout=10)
        assert info.value.code == "too_many_images" and bad.status == "failed"
        assert session.send(_msg("again")).wait(timeout=10).output_text == TEXT
    creates = [e for e in stub.state.ws_events if e["type"] == "response.create"]
    assert creates[0]["response"]["max_tokens"] == 500 and creates[0]["response"]["id"] == slow.id
    assert {"type": "response.cancel", "response_id": slow.id} in stub.state.ws_events


def test_session_auth_and_close(keyed_stub: StubServer) -> None:
    with Client(keyed_stub.url) as c, pytest.raises(AuthenticationError) as info:
        c.chat.session().connect()
    assert info.value.status_code == 401
    with Client(keyed_stub.url, api_key="sekrit") as c:
        session = c.chat.session().connect()
        pending = session.send(_msg("ws-slow"))
        session.close()
        with pytest.raises(APIConnectionError):
            pending.wait(timeout=10)


# ------------------------------------------------------------------------------------------ async


@pytest.mark.anyio
async def test_async_chat_stream_session_files(stub: StubServer, sleeps: list[float]) -> None:
    async with AsyncClient(stub.url) as c:
        out = await c.chat.completions.create(messages=_msg("flaky503:async"))
        assert out.choices[0].message.content == TEXT and sleeps == [2.0]
        assert stub.state.attempts["flaky503:async"] == 2
        stream = await c.chat.completions.create(messages=_msg("hi"), stream=True)
        async with stream:
            deltas = [d async for d in stream.text_stream]
        assert "".join(deltas) == TEXT and stream.response.is_closed
        stream = await c.chat.completions.create(messages=_msg("hi"), stream=True)
        assert await stream.get_final_text() == TEXT
        async with await c.chat.completions.create(messages=_msg("stream-error"), stream=True) as stream:
            with pytest.raises(APIError):
                await stream.get_final_text()
        with pytest.raises(NotFoundError) as info:
            await c.chat.completions.create(messages=_msg("error:404:model_not_found"))
        assert info.value.request_id == "req_404"

        async with c.chat.session() as session:
            slow = await session.send(_msg("ws-slow"))
            fast = await session.send(_msg("hi"))
            async for _ in slow:
                break
            await slow.cancel()
            assert "".join([d async for d in fast]) == TEXT
            assert (await fast.wait(10)).status == "completed"
            assert (await slow.wait(10)).status == "cancelled"

        f = await c.files.create(file=("a.png", _png()))
        assert await c.files.content(f.id) == _png()
        assert (await c.files.retrieve(f.id)).id == f.id
        assert f.id in {x.id for x in (await c.files.list()).data}
        assert (await c.files.delete(f.id)).deleted
        part = await avideo_part(f.id)
        assert part == {"type": "video_url", "video_url": {"url": f.id}}


@pytest.mark.anyio
async def test_async_timeout_and_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with AsyncClient(f"http://127.0.0.1:{port}", max_retries=0) as c:
        with pytest.raises(APIConnectionError):
            await c.models.list()


# ------------------------------------------------------------------------------------------ media


def _decode_data_url(url: str) -> tuple[str, bytes]:
    head, b64 = url.split(",", 1)
    return head[len("data:") : -len(";base64")], base64.b64decode(b64)


def test_image_part(tmp_path: Path) -> None:
    img = Image.new("RGB", (9, 4), (0, 128, 255))
    mime, data = _decode_data_url(image_part(img)["image_url"]["url"])
    assert mime == "image/png" and Image.open(io.BytesIO(data)).size == (9, 4)
    buf = io.BytesIO()
    img.save(buf, format="JPEG")
    part = image_part(buf.getvalue())
    assert part["type"] == "image_url"
    assert _decode_data_url(part["image_url"]["url"]) == ("image/jpeg", buf.getvalue())
    path = tmp_path / "pic.bin"  # the type comes from the bytes, not the name
    path.write_bytes(_png())
    assert _decode_data_url(image_part(path)["image_url"]["url"]) == ("image/png", _png())
    with pytest.raises(ValueError):
        image_part(b"not an image")


def test_video_part(client: Client, stub: StubServer, tmp_path: Path) -> None:
    assert video_part("file-abc123") == {"type": "video_url", "video_url": {"url": "file-abc123"}}
    path = tmp_path / "clip.mp4"
    path.write_bytes(MP4_HEAD)
    part = video_part(path, client)
    fid = part["video_url"]["url"]
    assert fid.startswith("file-") and stub.state.files[fid][1] == MP4_HEAD
    mime, data = _decode_data_url(video_part(str(path))["video_url"]["url"])  # no client: small -> inlined
    assert (mime, data) == ("video/mp4", MP4_HEAD)
    with pytest.raises(FileNotFoundError):
        video_part(tmp_path / "missing.mp4", client)
