"""`Stream` / `AsyncStream`: a chat-completion SSE response read as typed chunks.

A stream owns its HTTP response and closes it on exhaustion, on error, on `close()` and on leaving
its `with` block. `data: {"error": ...}` inside the stream raises APIError; a stream that ends
without `data: [DONE]` raises APIConnectionError. Knows nothing of retries (a returned stream is
never retried).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from types import TracebackType

import httpx

from mmserve.client.errors import APIConnectionError, APIError, APITimeoutError, error_fields
from mmserve.client.types import ChatCompletionChunk, Usage


class _SSEDecoder:
    """Line-by-line SSE: `data:` lines accumulate until a blank line ends the event."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        if not line:
            return self.flush()
        if line.startswith(":"):  # comment / keep-alive
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # `event:`, `id:`, `retry:` carry nothing the chat stream uses

    def flush(self) -> str | None:
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


class _StreamState:
    """What both stream flavours accumulate: text of choice 0, finish reason, usage."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.request_id: str | None = response.headers.get("x-request-id")
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.completed = False  # saw `[DONE]`
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """Text of choice 0 received so far."""
        return "".join(self._parts)

    def _parse(self, data: str) -> ChatCompletionChunk:
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise APIError(f"Malformed stream event: {data[:200]!r}", request_id=self.request_id) from exc
        if isinstance(obj, dict) and "error" in obj:
            fields = error_fields(obj)
            message = fields.pop("message") or "Error in stream"
            raise APIError(message, body=obj, request_id=self.request_id, **fields)
        chunk = ChatCompletionChunk.model_validate(obj)
        for choice in chunk.choices:
            if choice.index == 0:
                if choice.delta.content:
                    self._parts.append(choice.delta.content)
                if choice.finish_reason is not None:
                    self.finish_reason = choice.finish_reason
        if chunk.usage is not None:
            self.usage = chunk.usage
        return chunk

    def _ended_early(self) -> APIConnectionError:
        return APIConnectionError("Stream ended before [DONE]", request_id=self.request_id)


def _map_transport(exc: httpx.TransportError) -> APIConnectionError:
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError()
    return APIConnectionError(f"Stream broken: {exc}")


class Stream(_StreamState):
    """Iterate for `ChatCompletionChunk`s, or use `text_stream` / `get_final_text()`; one pass only."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response)
        self._iterator = self._chunks()

    def _chunks(self) -> Generator[ChatCompletionChunk, None, None]:
        decoder = _SSEDecoder()
        try:
            for line in self.response.iter_lines():
                data = decoder.feed(line)
                if data is None:
                    continue
                if data.strip() == "[DONE]":
                    self.completed = True
                    return
                yield self._parse(data)
            data = decoder.flush()
            if data is not None and data.strip() == "[DONE]":
                self.completed = True
                return
            raise self._ended_early()
        except httpx.TransportError as exc:
            raise _map_transport(exc) from exc
        finally:
            self.response.close()

    def __iter__(self) -> Iterator[ChatCompletionChunk]:
        return self._iterator

    def __next__(self) -> ChatCompletionChunk:
        return next(self._iterator)

    @property
    def text_stream(self) -> Iterator[str]:
        """Non-empty text deltas of choice 0."""
        for chunk in self._iterator:
            for choice in chunk.choices:
                if choice.index == 0 and choice.delta.content:
                    yield choice.delta.content

    def get_final_text(self) -> str:
        """Consume the rest of the stream; the whole text of choice 0 (including parts already read)."""
        for _ in self._iterator:
            pass
        return self.text

    def close(self) -> None:
        self._iterator.close()  # runs the generator's `finally` if it had started
        self.response.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncStream(_StreamState):
    """Async twin of `Stream`: `async for`, `text_stream`, `await get_final_text()`, `async with`."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response)
        self._iterator = self._chunks()

    async def _chunks(self) -> AsyncGenerator[ChatCompletionChunk, None]:
        decoder = _SSEDecoder()
        try:
            async for line in self.response.aiter_lines():
                data = decoder.feed(line)
                if data is None:
                    continue
                if data.strip() == "[DONE]":
                    self.completed = True
                    return
                yield self._parse(data)
            data = decoder.flush()
            if data is not None and data.strip() == "[DONE]":
                self.completed = True
                return
            raise self._ended_early()
        except httpx.TransportError as exc:
            raise _map_transport(exc) from exc
        finally:
            await self.response.aclose()

    def __aiter__(self) -> AsyncIterator[ChatCompletionChunk]:
        return self._iterator

    async def __anext__(self) -> ChatCompletionChunk:
        return await self._iterator.__anext__()

    @property
    def text_stream(self) -> AsyncIterator[str]:
        """Non-empty text deltas of choice 0 (`async for delta in stream.text_stream`)."""
        return self._text()

    async def _text(self) -> AsyncIterator[str]:
        async for chunk in self._iterator:
            for choice in chunk.choices:
                if choice.index == 0 and choice.delta.content:
                    yield choice.delta.content

    async def get_final_text(self) -> str:
        async for _ in self._iterator:
            pass
        return self.text

    async def close(self) -> None:
        await self._iterator.aclose()
        await self.response.aclose()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
