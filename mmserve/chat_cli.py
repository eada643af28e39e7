"""`mmserve chat`: a terminal chat over the server's WebSocket. Streams replies as they arrive;
`/image PATH` and `/video PATH` attach media to the next message; Ctrl-C stops a reply."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TextIO

from mmserve.client import APIError, Client, image_part, video_part

HELP = """commands: /image PATH  /video PATH  (attach to your next message)
          /reset (forget the conversation)  /help  /quit"""


def run_chat(args: argparse.Namespace, read: Callable[[str], str] = input, out: TextIO = sys.stdout) -> int:
    client = Client(args.url, api_key=args.api_key)
    history: list[dict[str, Any]] = []
    attached: list[dict[str, Any]] = []
    with client.chat.session() as session:
        print(f"connected to {args.url} — {HELP.splitlines()[0]}", file=out)
        while True:
            try:
                line = read("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                print(file=out)
                return 0
            if not line:
                continue
            command, _, rest = line.partition(" ")
            if command in ("/quit", "/exit"):
                return 0
            if command == "/help":
                print(HELP, file=out)
                continue
            if command == "/reset":
                history.clear()
                attached.clear()
                continue
            if command in ("/image", "/video"):
                try:
                    part = image_part(rest) if command == "/image" else video_part(rest, client=client)
                except (OSError, ValueError, APIError) as exc:
                    print(f"! could not attach {rest!r}: {exc}", file=out)
                    continue
                attached.append(part)
                print(f"(attached {command[1:]} {rest}; it goes with your next message)", file=out)
                continue
            content: str | list[dict[str, Any]] = (
                [*attached, {"type": "text", "text": line}] if attached else line
            )
            history.append({"role": "user", "content": content})
            attached = []
            handle = session.send(history, max_tokens=args.max_tokens, temperature=args.temperature)
            print("assistant> ", end="", file=out, flush=True)
            try:
                for delta in handle:
                    print(delta, end="", file=out, flush=True)
            except KeyboardInterrupt:
                handle.cancel()
            except APIError as exc:
                print(f"\n! {exc}", file=out)
                history.pop()
                continue
            result = handle.wait(timeout=30)
            print(f"\n  [{result.finish_reason or result.status}]", file=out)
            history.append({"role": "assistant", "content": result.output_text})
