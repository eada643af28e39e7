"""The SDK (`mmserve.client`) against the REAL server: `create_app` over a real `AsyncEngine` on the tiny
Qwen2-VL checkpoint, served by uvicorn on a free local port. Skipped until `mmserve.api.app` imports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mmserve.client import (
    APIError,
    AsyncClient,
    AuthenticationError,
    Client,
    NotFoundError,
    UnprocessableEntityError,
    UnsupportedMediaTypeError,
    image_part,
    video_part,
)

try:
    from mmserve.api.app import create_app
    from mmserve.api.server import ServerThread
    from mmserve.api.settings import ServerSettings
except ImportError as exc:  # the server lands separately
    pytest.skip(f"mmserve.api.app is not importable yet ({exc})", allow_module_level=True)

from mmserve.config import EngineArgs
from mmserve.engine.async_engine import AsyncEngine

ASSETS = Path(__file__).resolve().parent.parent / "assets"
KEY = "sk-sdk"
HELLO = [{"role": "user", "content": "Describe a red circle on a white background."}]
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def live_url(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    engine = AsyncEngine(
        EngineArgs(
            str(tiny_model_dir("qwen2_vl")), max_num_batched_tokens=128, max_model_len=2048, num_kv_blocks=256
        )
    )
    settings = ServerSettings(
        api_key=KEY, data_dir=tmp_path_factory.mktemp("sdk-data"), served_model_name="tiny"
    )
    server = ServerThread(lambda: create_app(engine, settings))
    yield server.url
    server.stop()
    asyncio.run(engine.shutdown(1.0))


@pytest.fixture
def client(live_url: str) -> Iterator[Client]:
    with Client(live_url, api_key=KEY, timeout=120) as c:
        yield c


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_greedy_text_agrees_json_stream_session(client: Client) -> None:
    text = client.chat.completions.create(messages=HELLO, **GREEDY).choices[0].message.content
    assert text
    with client.chat.completions.create(
        messages=HELLO, stream=True, stream_options={"include_usage": True}, **GREEDY
    ) as stream:
        assert stream.get_final_text() == text
    assert (
        stream.usage is not None
        and stream.usage.completion_tokens == stream.usage.total_tokens - stream.usage.prompt_tokens
    )
    with client.chat.session() as session:
        result = session.send(HELLO, **GREEDY).wait(timeout=120)
    # A random tiny model rarely stops by itself; hitting max_tokens is `incomplete` (Realtime's rule).
    assert result.status in ("completed", "incomplete") and result.output_text == text
    assert client.models.list().data[0].id == "tiny"


def test_session_two_responses_cancel_one(client: Client) -> None:
    with client.chat.session() as session:
        long = session.send(HELLO, max_tokens=1000, ignore_eos=True, temperature=0.0)
        short = session.send(HELLO, **GREEDY)
        next(iter(long))
        long.cancel()
        assert short.wait(timeout=120).status in ("completed", "incomplete")
        assert long.wait(timeout=120).status == "cancelled"
        assert short.usage is not None and short.usage.completion_tokens <= 8


def test_files_round_trip_and_chat_by_id(client: Client) -> None:
    photo = (ASSETS / "sample.jpg").read_bytes()
    f = client.files.create(file=ASSETS / "sample.jpg")
    assert (f.media_type, f.bytes) == ("image", len(photo)) and f.width and f.height
    assert client.files.retrieve(f.id) == f and client.files.content(f.id) == photo
    assert f.id in {x.id for x in client.files.list().data}
    content = [{"type": "image_url", "image_url": {"url": f.id}}, {"type": "text", "text": "What is this?"}]
    assert client.chat.completions.create(messages=[{"role": "user", "content": content}], **GREEDY).choices
    clip = video_part(ASSETS / "sample_clip.mp4", client)
    inline = image_part(ASSETS / "sample.jpg")
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": [clip, inline, {"type": "text", "text": "Compare."}]}], **GREEDY
    )
    assert out.usage is not None and out.usage.prompt_tokens > 50  # media expanded into many tokens
    assert client.files.delete(f.id).deleted
    with pytest.raises(NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(UnsupportedMediaTypeError):
        client.files.create(file=("notes.mp4", b"not a video at all"))


def test_errors(live_url: str, client: Client) -> None:
    with Client(live_url, api_key="wrong") as bad, pytest.raises(AuthenticationError) as info:
        bad.models.list()
    assert info.value.code == "invalid_api_key"
    with pytest.raises(UnprocessableEntityError) as schema:
        client.chat.completions.create(messages=HELLO, extra_body={"max_tokens": "many"})
    assert schema.value.param is not None
    # The WS handshake refuses a bad key before accept with HTTP 401, like the HTTP routes.
    with (
        Client(live_url, api_key="wrong") as bad,
        pytest.raises(AuthenticationError),
    ):
        bad.chat.session().connect()
    with client.chat.session() as session:
        with pytest.raises(APIError):
            session.send(
                [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "file-" + "0" * 24}}],
                    }
                ]
            ).wait(timeout=60)
        assert session.send(HELLO, **GREEDY).wait(timeout=120).status != "failed"  # still usable


@pytest.mark.anyio
async def test_async_client(live_url: str) -> None:
    async with AsyncClient(live_url, api_key=KEY, timeout=120) as c:
        out = await c.chat.completions.create(messages=HELLO, **GREEDY)
        stream = await c.chat.completions.create(messages=HELLO, stream=True, **GREEDY)
        async with stream:
            deltas = [d async for d in stream.text_stream]
        assert "".join(deltas) == out.choices[0].message.content
        async with c.chat.session() as session:
            a = await session.send(HELLO, max_tokens=1000, ignore_eos=True)
            b = await session.send(HELLO, **GREEDY)
            async for _ in a:
                break
            await a.cancel()
            assert (await b.wait(120)).output_text == out.choices[0].message.content
            assert (await a.wait(120)).status == "cancelled"


@pytest.mark.anyio
async def test_cancel_right_after_send_still_ends_the_response(live_url: str) -> None:
    """Two creates and a cancel back to back: the cancel reaches the server before the first response's
    task has run; it must still end with `response.done` (cancelled), or the client waits forever."""
    async with AsyncClient(live_url, api_key=KEY, timeout=120) as c, c.chat.session() as session:
        a = await session.send(HELLO, max_tokens=1000, ignore_eos=True)
        b = await session.send(HELLO, **GREEDY)
        await a.cancel()
        assert (await a.wait(20)).status == "cancelled"
        assert (await b.wait(120)).status != "failed"


def test_terminal_chat_streams_replies_and_attaches_media(live_url: str) -> None:
    """`mmserve chat` driven with scripted input against the live server."""
    import argparse
    import io

    from mmserve.chat_cli import run_chat

    lines = iter([
        "/help", "/image " + str(ASSETS / "sample.jpg"), "/video " + str(ASSETS / "sample_clip.mp4"),
        "What do you see?", "/image /no/such/file.png", "And now?", "/quit",
    ])  # fmt: skip
    out = io.StringIO()
    args = argparse.Namespace(url=live_url, api_key=KEY, max_tokens=6, temperature=0.0)
    assert run_chat(args, read=lambda prompt: next(lines), out=out) == 0
    text = out.getvalue()
    assert "attached image" in text and "attached video" in text
    assert text.count("assistant> ") == 2 and text.count("[length]") == 2
    assert "could not attach" in text
