"""`POST /v1/chat/completions`, OpenAI-compatible JSON and SSE. Errors before the first token are HTTP errors,
later ones an in-band `data: {"error"}`; a client that disconnects aborts its request."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from mmserve.api import convert
from mmserve.api.app import ServerState, State
from mmserve.api.errors import APIError, from_engine_error
from mmserve.api.limits import bearer, key_id, release_at_end
from mmserve.api.protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    ErrorResponse,
    ServiceTier,
)
from mmserve.engine.output_processor import RequestOutput

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: State
) -> ChatCompletion | StreamingResponse:
    arrival_time = time.monotonic()  # TTFT counts from here: media fetch and decode are part of it
    engine = state.engine
    # One slot of this key's concurrency limit from here until the response ends (429 if none is left).
    release = state.limiter.acquire(key_id(bearer(request.headers.get("authorization"))))
    try:
        messages, counts = await state.resolver.resolve(body.messages)
        params = convert.sampling_params(body, engine.max_model_len)
    except BaseException:
        release()
        raise
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    stream = release_at_end(engine.chat(messages, params, request_id, arrival_time=arrival_time), release)
    try:
        first = await anext(stream)  # processing errors surface here, before any byte is sent
    except StopAsyncIteration:  # not expected: every stream ends with a finished output
        raise from_engine_error(RuntimeError("the engine ended the request without output")) from None
    except BaseException:
        await stream.aclose()
        raise
    state.metrics.count_media(counts)
    top_n = body.top_logprobs or 0
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        tier = convert.service_tier(body.service_tier, first)  # the class it is served in, known from the first output
        events = _sse(state, stream, first, request_id, include_usage, top_n, tier)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    out = await _final_or_disconnect(request, stream, first)
    return ChatCompletion(
        id=request_id,
        model=state.model_name,
        choices=[
            Choice(
                message=AssistantMessage(content=out.text),
                logprobs=convert.logprobs(out, engine.tokenizer, 0, top_n),
                finish_reason=out.finish_reason,
            )
        ],
        usage=convert.usage(out),
        service_tier=convert.service_tier(body.service_tier, out),
    )


async def _final_or_disconnect(
    request: Request, stream: AsyncIterator[RequestOutput], first: RequestOutput
) -> RequestOutput:
    """Drains the stream to its final output; a client that hangs up first aborts the request."""

    async def drain() -> RequestOutput:
        out = first
        async with aclosing(stream):  # cancelled -> closes the stream -> the engine aborts the request
            async for out in stream:  # noqa: B007 - the last one is the final output
                pass
        return out

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


async def _sse(
    state: ServerState,
    stream: AsyncIterator[RequestOutput],
    first: RequestOutput,
    request_id: str,
    include_usage: bool,
    top_n: int,
    service_tier: ServiceTier | None = None,
) -> AsyncIterator[str]:
    created = int(time.time())
    tokenizer = state.engine.tokenizer

    def chunk(choices: list[ChunkChoice], usage: object = None) -> str:
        obj = ChatCompletionChunk(id=request_id, created=created, model=state.model_name, choices=choices,
                                  service_tier=service_tier)  # fmt: skip
        data = obj.model_dump(exclude_none=True)
        if include_usage:
            data["usage"] = usage  # OpenAI: null on every chunk but the usage one
        for c in data["choices"]:
            c.setdefault("logprobs", None)
            c.setdefault("finish_reason", None)
        return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"

    async with aclosing(stream):  # leaving early (disconnect -> cancellation) aborts the request
        yield chunk([ChunkChoice(delta=Delta(role="assistant", content=""))])
        out, sent_tokens = first, 0
        try:
            while True:
                if out.new_text or out.finished:
                    logprobs = convert.logprobs(out, tokenizer, sent_tokens, top_n)
                    sent_tokens = len(out.token_ids)
                    delta = Delta(content=out.new_text) if out.new_text else Delta()
                    yield chunk(
                        [ChunkChoice(delta=delta, logprobs=logprobs, finish_reason=out.finish_reason)]
                    )
                if out.finished:
                    break
                out = await anext(stream)
        except Exception as exc:  # the stream has started: report in-band
            body = ErrorResponse(error=from_engine_error(exc).info()).model_dump()
            yield f"data: {json.dumps(body)}\n\n"
            return
        if include_usage:
            yield chunk([], convert.usage(out).model_dump())
        yield "data: [DONE]\n\n"
