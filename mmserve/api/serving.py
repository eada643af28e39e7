"""What the chat and completions routes share: a request's engine streams (one per prompt, each with its n
sequences) started together, merged into one stream of (choice index, output), drained to each choice's
final output (a client that hangs up aborts them) or framed as SSE. Knows outputs, not wire shapes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

__all__ = ["aclosing", "close_all", "final_outputs", "merged", "sse", "sse_error", "start", "text_event"]
from typing import Any

from fastapi import Request

from mmserve.api.errors import APIError, from_engine_error
from mmserve.engine.output_processor import RequestOutput

Stream = AsyncIterator[RequestOutput]
_END = object()


async def start(streams: list[Stream]) -> list[RequestOutput]:
    """The first output of every stream, awaited together (so every prompt reaches the engine at once).
    Processing errors surface here, before any byte is sent: then every stream is closed (aborted)."""
    results = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    error = next((r for r in results if isinstance(r, BaseException)), None)
    if error is None:
        return list(results)  # type: ignore[arg-type]  # no exception among them
    await close_all(streams)
    if isinstance(error, StopAsyncIteration):  # not expected: every stream ends with a finished output
        raise from_engine_error(RuntimeError("the engine ended the request without output"))
    raise error


async def close_all(streams: list[Stream]) -> None:
    for stream in streams:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


async def merged(
    streams: list[Stream], firsts: list[RequestOutput], n: int, on_close: Callable[[], None] | None = None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) for every output of every stream, in arrival order, starting with `firsts`;
    stream k's sequence i is choice k * n + i. Leaving early closes (aborts) every stream; `on_close` runs
    once all are closed."""
    try:
        if len(streams) == 1:
            yield firsts[0].index, firsts[0]
            async for out in streams[0]:
                yield out.index, out
            return
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump(k: int, stream: Stream, first: RequestOutput) -> None:
            try:
                queue.put_nowait((k * n + first.index, first))
                async for out in stream:
                    queue.put_nowait((k * n + out.index, out))
                queue.put_nowait(_END)
            except Exception as exc:  # the consumer re-raises it
                queue.put_nowait(exc)

        pumps = [
            asyncio.create_task(pump(k, s, f)) for k, (s, f) in enumerate(zip(streams, firsts, strict=True))
        ]
        try:
            open_streams = len(pumps)
            while open_streams:
                item = await queue.get()
                if item is _END:
                    open_streams -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
    finally:
        await close_all(streams)
        if on_close is not None:
            on_close()


async def final_outputs(
    request: Request, outputs: AsyncIterator[tuple[int, RequestOutput]]
) -> dict[int, RequestOutput]:
    """Drains `outputs` to the last output of each choice; a client that hangs up first aborts them all."""

    async def drain() -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async with aclosing(outputs):  # cancelled -> closes the streams -> the engine aborts the requests
            async for index, out in outputs:
                finals[index] = out
        return finals

    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":  # the body is already read
            pass

    drainer, watcher = asyncio.create_task(drain()), asyncio.create_task(hang_up())
    try:
        await asyncio.wait((drainer, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not drainer.done():
            drainer.cancel()
            await asyncio.gather(drainer, return_exceptions=True)
    if drainer.cancelled():
        raise APIError(499, "the client closed the connection", code="client_closed_request")
    return drainer.result()


def sse(data: object) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


_MARK = "\x00mmserve text\x00"  # never in a model name or an id; its JSON is unique in any event
_MARK_JSON = json.dumps(_MARK)


def text_event(render: Callable[[str], str]) -> Callable[[str], str]:
    """`render(text)` (an event whose only varying part is the string field `text`) as a template: rendered
    once with a marker for the text, then each event is the two halves around `json.dumps(text)`, byte for
    byte what `render` gives (the same encoder escapes a string alone as inside the event). A stream's
    content deltas take this path: building and dumping the models once a token per stream is the event
    loop's largest share of a token's CPU at low concurrency."""
    head, found, tail = render(_MARK).partition(_MARK_JSON)
    if not found or _MARK_JSON in tail:
        return render
    return lambda text: head + json.dumps(text) + tail


def sse_error(exc: BaseException) -> str:
    """The in-band error event that ends a stream that has started."""
    from mmserve.api.protocol import ErrorResponse

    return sse(ErrorResponse(error=from_engine_error(exc).info()).model_dump())
