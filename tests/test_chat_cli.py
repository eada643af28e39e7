"""`mmserve chat` as a user meets it: a server that is down or restarts is one line and a reconnect, never
a traceback; bad options fail before connecting; `/video` without a path is answered locally.

The server here is a stand-in speaking the WebSocket chat's events (tests/test_api*.py cover the real one),
so these tests need no model and run in about a second."""

from __future__ import annotations

import argparse
import io
import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.sync.server import Server, ServerConnection, serve

from mmserve.chat_cli import RETRY_DELAYS_S, run_chat
from mmserve.cli import main


@dataclass
class FakeChatServer:
    """Accepts sessions on /v1/chat/ws; answers each `response.create` with "hi" unless `drop_next` is
    set, in which case it closes that socket instead (a server going away mid-request)."""

    drop_next: int = 0
    loading: int = 0  # handshakes answered 503, as while a restarted server loads its model
    sessions: int = 0
    creates: list[dict] = field(default_factory=list)

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if self.loading:
            self.loading -= 1
            return connection.respond(503, "loading")
        return None

    def handle(self, ws: ServerConnection) -> None:
        self.sessions += 1
        ws.send(json.dumps({"type": "session.created", "session": {"id": f"sess_{self.sessions}"}}))
        try:
            for message in ws:
                event = json.loads(message)
                if event.get("type") != "response.create":
                    continue
                self.creates.append(event)
                if self.drop_next:
                    self.drop_next -= 1
                    ws.close()
                    return
                rid = event["response"]["id"]
                ws.send(
                    json.dumps({"type": "response.created", "response": {"id": rid, "status": "in_progress"}})
                )
                ws.send(json.dumps({"type": "response.output_text.delta", "response_id": rid, "delta": "hi"}))
                done = {"id": rid, "status": "completed", "output_text": "hi", "finish_reason": "stop"}
                ws.send(json.dumps({"type": "response.done", "response": done}))
        except ConnectionClosed:
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_server() -> Iterator[tuple[FakeChatServer, str]]:
    fake = FakeChatServer()
    port = _free_port()
    server: Server = serve(fake.handle, "127.0.0.1", port, process_request=fake.process_request)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        thread.join(timeout=5)


def _args(url: str) -> argparse.Namespace:
    return argparse.Namespace(url=url, api_key=None, max_tokens=16, temperature=0.7)


def _lines(*lines: str) -> Callable[[str], str]:
    """A `read` that types `lines`, then ends the input."""
    queue = list(lines)

    def read(prompt: str) -> str:
        if not queue:
            raise EOFError
        return queue.pop(0)

    return read


def test_server_down_is_one_line_then_gives_up_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = io.StringIO()
    waits: list[float] = []
    rc = run_chat(_args(f"http://127.0.0.1:{_free_port()}"), _lines("hello"), out, sleep=waits.append)
    text = out.getvalue()
    assert rc == 1
    assert waits == list(RETRY_DELAYS_S)  # bounded backoff
    lines = text.strip().splitlines()
    assert len(lines) == 2, text
    assert (
        lines[0].startswith("! cannot reach the server at http://127.0.0.1:")
        and "connection refused" in lines[0]
    )
    assert lines[1].startswith("! gave up:")
    captured = capsys.readouterr()
    assert "Traceback" not in text + captured.out + captured.err


def test_a_server_that_drops_the_session_is_reconnected_and_the_chat_goes_on(
    fake_server: tuple[FakeChatServer, str],
) -> None:
    fake, url = fake_server
    fake.drop_next = 1
    out = io.StringIO()
    rc = run_chat(_args(url), _lines("hello", "hello again"), out, sleep=lambda s: None)
    text = out.getvalue()
    assert rc == 0, text
    assert "Traceback" not in text
    assert text.count("! lost the connection to the server") == 1
    assert "(reconnected to" in text and "send it again" in text
    assert "assistant> hi" in text
    assert fake.sessions == 2
    # The conversation survived the reconnect: the unanswered message is not in the second request.
    assert [m["content"] for m in fake.creates[-1]["response"]["messages"]] == ["hello again"]


def test_a_loading_server_is_waited_for(fake_server: tuple[FakeChatServer, str]) -> None:
    fake, url = fake_server
    fake.loading = 2
    out = io.StringIO()
    waits: list[float] = []
    rc = run_chat(_args(url), _lines("hello"), out, sleep=waits.append)
    text = out.getvalue()
    assert rc == 0, text
    assert waits == list(RETRY_DELAYS_S[:2])
    assert "! cannot reach the server" in text and "503" in text and "(reconnected to" in text
    assert "assistant> hi" in text


@pytest.mark.parametrize("command", ["/video", "/video   ", "/image"])
def test_media_command_without_a_path_is_answered_locally(
    fake_server: tuple[FakeChatServer, str], command: str
) -> None:
    fake, url = fake_server
    out = io.StringIO()
    rc = run_chat(_args(url), _lines(command, "/quit"), out, sleep=lambda s: None)
    kind = command.split()[0]
    assert rc == 0
    assert f"! {kind} needs a path: {kind} PATH" in out.getvalue()
    assert fake.creates == []  # nothing was sent


@pytest.mark.parametrize("value", ["5", "-0.1", "nan", "warm"])
def test_out_of_range_temperature_fails_at_start(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse: before any connection is tried
        main(["chat", "--url", f"http://127.0.0.1:{_free_port()}", "--temperature", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--temperature" in err and "Traceback" not in err


def test_the_api_range_is_accepted_and_max_tokens_checked_too(capsys: pytest.CaptureFixture[str]) -> None:
    from mmserve.cli import _chat_max_tokens, _chat_temperature

    assert [_chat_temperature(v) for v in ("0", "0.7", "2")] == [0.0, 0.7, 2.0]
    assert _chat_max_tokens("1") == 1
    with pytest.raises(SystemExit) as exc:
        main(["chat", "--max-tokens", "0"])
    assert exc.value.code == 2 and "--max-tokens" in capsys.readouterr().err
