"""`mmserve chat`: a terminal chat over the server's WebSocket. Streams replies as they arrive;
`/image PATH` and `/video PATH` attach media to the next message; Ctrl-C stops a reply.

A server that is down or restarts is one line, then reconnection with bounded backoff (never a traceback);
the conversation lives here, so it survives a reconnect. Knows the SDK's session API, not the wire protocol.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from mmserve.client import APIConnectionError, APIError, APIStatusError, Client, image_part, video_part
from mmserve.client.session import ChatSession

HELP = """commands: /image PATH  /video PATH  (attach to your next message)
          /reset (forget the conversation)  /help  /quit"""
# Seconds to wait before each reconnection attempt (a restarting server loads its model first); after the
# last one the chat gives up, ~40 s in all.
RETRY_DELAYS_S: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0)
REPLY_TIMEOUT_S = 30.0  # for `response.done` once the deltas have ended


def run_chat(
    args: argparse.Namespace,
    read: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
    sleep: Callable[[float], None] = time.sleep,
    retry_delays_s: Sequence[float] = RETRY_DELAYS_S,
) -> int:
    """The chat loop; 0 on /quit or end of input, 1 when the server cannot be reached (after retrying)."""
    chat = _Chat(args, out, sleep, retry_delays_s)
    try:
        return chat.run(read)
    except KeyboardInterrupt:  # Ctrl-C while connecting or waiting to retry
        print(file=out)
        return 130
    finally:
        chat.close()


class _Chat:
    def __init__(
        self, args: argparse.Namespace, out: TextIO, sleep: Callable[[float], None], delays: Sequence[float]
    ) -> None:
        self.args, self.out, self.sleep, self.delays = args, out, sleep, tuple(delays)
        self.client = Client(args.url, api_key=args.api_key)
        self.session: ChatSession | None = None
        self.history: list[dict[str, Any]] = []
        self.attached: list[dict[str, Any]] = []

    def say(self, text: str, end: str = "\n") -> None:
        print(text, end=end, file=self.out, flush=True)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
        self.client.close()

    def connect(self, lost: bool) -> bool:
        """Open a session, retrying a server that cannot be reached; False once it gives up (said why)."""
        url = self.args.url
        if self.session is not None:
            self.session.close()
            self.session = None
        if lost:
            self.say(f"! lost the connection to the server at {url}; reconnecting…")
        for attempt in range(len(self.delays) + 1):
            try:
                self.session = self.client.chat.session().connect()
            except APIStatusError as exc:
                if (
                    exc.status_code < 500
                ):  # the server answered and refused (a bad key...): retrying will not help
                    self.say(f"! the server at {url} refused the chat ({exc.status_code}): {_one_line(exc)}")
                    return False
                failure: APIError = exc  # 503 while the model loads or the server drains: it may come back
            except APIConnectionError as exc:
                failure = exc
            else:
                if lost or attempt:
                    self.say(f"(reconnected to {url})")
                return True
            if attempt == len(self.delays):
                break
            if attempt == 0 and not lost:
                self.say(f"! cannot reach the server at {url} ({_reason(failure)}); retrying…")
            self.sleep(self.delays[attempt])
        self.say(
            f"! gave up: no server at {url} after {len(self.delays) + 1} tries ({sum(self.delays):g} s); is it running?"
        )
        return False

    def run(self, read: Callable[[str], str]) -> int:
        if not self.connect(lost=False):
            return 1
        self.say(f"connected to {self.args.url} — {HELP.splitlines()[0]}")
        while True:
            try:
                line = read("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                self.say("")
                return 0
            if not line:
                continue
            command, _, rest = line.partition(" ")
            rest = rest.strip()
            if command in ("/quit", "/exit"):
                return 0
            if command == "/help":
                self.say(HELP)
            elif command == "/reset":
                self.history.clear()
                self.attached.clear()
            elif command in ("/image", "/video"):
                self.attach(command[1:], rest)
            elif not self.reply(line):
                return 1

    def attach(self, kind: str, path: str) -> None:
        if not path:  # said here: an empty video reference would otherwise go to the server as a file id
            self.say(f"! /{kind} needs a path: /{kind} PATH")
            return
        try:
            part = image_part(path) if kind == "image" else video_part(path, client=self.client)
        except (OSError, ValueError, APIError) as exc:
            self.say(f"! could not attach {path!r}: {_one_line(exc)}")
            return
        self.attached.append(part)
        self.say(f"(attached {kind} {path}; it goes with your next message)")

    def reply(self, text: str) -> bool:
        """Send `text` (with what is attached) and stream the reply; False when the server is gone for good."""
        content: str | list[dict[str, Any]] = (
            [*self.attached, {"type": "text", "text": text}] if self.attached else text
        )
        self.history.append({"role": "user", "content": content})
        attached, self.attached = self.attached, []
        assert self.session is not None
        started = False
        try:
            handle = self.session.send(
                self.history, max_tokens=self.args.max_tokens, temperature=self.args.temperature
            )
            self.say("assistant> ", end="")
            started = True
            try:
                for delta in handle:
                    self.say(delta, end="")
            except KeyboardInterrupt:
                handle.cancel()
            result = handle.wait(timeout=REPLY_TIMEOUT_S)
        except APIConnectionError:
            # The server went away (stopped or restarted): keep the conversation, give back the attachments.
            self.history.pop()
            self.attached = attached
            if started:
                self.say("")
            if not self.connect(lost=True):
                return False
            self.say("(your last message was not answered; send it again)")
            return True
        except APIError as exc:  # an error event for this reply (bad media, prompt too long...)
            self.say(f"\n! {_one_line(exc)}")
            self.history.pop()
            return True
        self.say(f"\n  [{result.finish_reason or result.status}]")
        self.history.append({"role": "assistant", "content": result.output_text})
        return True


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _reason(exc: APIError) -> str:
    """What went wrong, in a few words: the OS error under the SDK's message when there is one."""
    if isinstance(exc, APIStatusError):
        return f"{exc.status_code}: {_one_line(exc)}"
    cause = exc.__cause__
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror.lower()
    return _one_line(exc)
