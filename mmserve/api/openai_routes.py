"""`POST /v1/chat/completions`, OpenAI-compatible JSON and SSE: n choices, tool calls read out of the output,
usage with cached prompt tokens. Errors before the first token are HTTP errors, later ones an in-band
`data: {"error"}`; a client that disconnects aborts its request."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from mmserve.api import convert, serving
from mmserve.api.app import ServerState, State
from mmserve.api.chat_request import PreparedChat, prepare_chat
from mmserve.api.errors import APIError
from mmserve.api.limits import bearer, key_id
from mmserve.api.protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    FunctionCallDelta,
    FunctionCallOut,
    ServiceTier,
    ToolCallDelta,
    ToolCallOut,
    unsupported_fields,
)
from mmserve.engine.output_processor import RequestOutput

if TYPE_CHECKING:
    from mmserve.api.tool_parsers import StreamDelta, ToolCallStream

router = APIRouter()


def refuse_unsupported(body: Any) -> None:
    """A 400 naming the first OpenAI field of `body` that would change the output but is not implemented."""
    bad = unsupported_fields(body)
    if bad:
        raise APIError(
            400, f"{bad[0]}: not supported by this server", code="unsupported_parameter", param=bad[0]
        )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: State
) -> ChatCompletion | StreamingResponse:
    arrival_time = time.monotonic()  # TTFT counts from here: media fetch and decode are part of it
    state.check_model(body.model)
    refuse_unsupported(body)
    engine = state.engine
    # One slot of this key's concurrency limit from here until the response ends (429 if none is left).
    release = state.limiter.acquire(key_id(bearer(request.headers.get("authorization"))))
    try:
        chat = await prepare_chat(state, body)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = engine.chat(
            chat.messages, chat.params, request_id, arrival_time=arrival_time, **chat.template
        )
        firsts = await serving.start([stream])
        try:
            convert.check_max_tokens(
                convert.requested_max_tokens(body), len(firsts[0].prompt_token_ids), engine.max_model_len
            )
        except BaseException:
            await serving.close_all([stream])
            raise
    except BaseException:
        release()
        raise
    outputs = serving.merged([stream], firsts, body.n, on_close=release)
    state.metrics.count_media(chat.counts)
    top_n = body.top_logprobs or 0
    if body.stream:
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        tier = convert.service_tier(body.service_tier, firsts[0])  # the class it is served in, known now
        events = _sse(state, chat, outputs, body.n, request_id, include_usage, continuous, top_n, tier)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    finals = await serving.final_outputs(request, outputs)
    choices = []
    for index in sorted(finals):
        out = finals[index]
        message, finish_reason = _message(out, chat, body.parallel_tool_calls)
        choices.append(Choice(index=index, message=message, finish_reason=finish_reason,
                              logprobs=convert.logprobs(out, engine.tokenizer, 0, top_n)))  # fmt: skip
    return ChatCompletion(
        id=request_id,
        model=state.model_name,
        choices=choices,
        usage=convert.usage(*finals.values()),
        service_tier=convert.service_tier(body.service_tier, finals[min(finals)]),
        kv_transfer_params=convert.kv_transfer_params(finals[min(finals)]),
    )


def _message(
    out: RequestOutput, chat: PreparedChat, parallel_tool_calls: bool | None
) -> tuple[AssistantMessage, str | None]:
    """The assistant message of a finished choice and its finish reason ("tool_calls" once it called one)."""
    if chat.tool_parser is None:
        return AssistantMessage(content=out.text), out.finish_reason
    parsed = chat.tool_parser.parse(out.text, tools=chat.tools)
    calls = parsed.tool_calls if parallel_tool_calls is not False else parsed.tool_calls[:1]
    if not calls:
        return AssistantMessage(content=out.text), out.finish_reason
    tool_calls = [
        ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls
    ]
    return AssistantMessage(content=parsed.content, tool_calls=tool_calls), "tool_calls"


class _ChoiceState:
    """One choice of a stream: tokens sent so far, and its tool-call reader."""

    def __init__(self, reader: ToolCallStream | None) -> None:
        self.reader = reader
        self.sent_tokens = 0
        self.called = False  # a tool call was streamed: finish_reason "tool_calls"

    def delta(self, new_text: str, finished: bool) -> Delta | None:
        if self.reader is None:
            return Delta(content=new_text) if new_text else None
        parts = [self.reader.feed(new_text)] if new_text else []
        if finished:
            parts.append(self.reader.finish())
        content = "".join(p.content or "" for p in parts) or None
        calls = [c for p in parts for c in _tool_call_deltas(p)]
        self.called |= bool(calls)
        if content is None and not calls:
            return None
        return Delta(content=content, tool_calls=calls or None)


def _tool_call_deltas(delta: StreamDelta) -> list[ToolCallDelta]:
    return [
        ToolCallDelta(
            index=c.index,
            id=c.id,
            type="function" if c.id is not None else None,
            function=FunctionCallDelta(name=c.name, arguments=c.arguments),
        )
        for c in delta.tool_calls
    ]


async def _sse(
    state: ServerState,
    chat: PreparedChat,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    n: int,
    request_id: str,
    include_usage: bool,
    continuous_usage: bool,
    top_n: int,
    service_tier: ServiceTier | None = None,
) -> AsyncIterator[str]:
    created = int(time.time())
    tokenizer = state.engine.tokenizer
    latest: dict[int, RequestOutput] = {}

    def chunk(choices: list[ChunkChoice], usage: object = None) -> str:
        obj = ChatCompletionChunk(id=request_id, created=created, model=state.model_name, choices=choices,
                                  service_tier=service_tier)  # fmt: skip
        data = obj.model_dump(exclude_none=True)
        if include_usage:  # OpenAI: null on every chunk but the usage one; vLLM's continuous: on every one
            data["usage"] = usage if usage is not None or not continuous_usage else _usage(latest)
        for c in data["choices"]:
            c.setdefault("logprobs", None)
            c.setdefault("finish_reason", None)
        return serving.sse(data)

    def content_event(index: int) -> Callable[[str], str]:
        """Choice `index`'s event for a content delta alone (no logprobs, not the last), as `chunk` renders it."""
        return serving.text_event(lambda text: chunk([ChunkChoice(index=index, delta=Delta(content=text))]))

    choices = {i: _ChoiceState(chat.tool_parser.stream(tools=chat.tools) if chat.tool_parser else None)
               for i in range(n)}  # fmt: skip
    # Per choice, the content-delta event as a template (None: every event through `chunk`): the usage on
    # every chunk (continuous) varies, so that case keeps the models.
    content_events: dict[int, Callable[[str], str]] | None = None if include_usage and continuous_usage else {}
    async with serving.aclosing(outputs):  # leaving early (disconnect -> cancellation) aborts the requests
        for i in range(n):
            yield chunk([ChunkChoice(index=i, delta=Delta(role="assistant", content=""))])
        try:
            async for index, out in outputs:
                latest[index] = out
                choice = choices[index]
                if (content_events is not None and choice.reader is None and out.logprobs is None
                        and out.new_text and not out.finished):  # fmt: skip
                    event = content_events.get(index)
                    if event is None:
                        event = content_events[index] = content_event(index)
                    choice.sent_tokens = len(out.token_ids)
                    yield event(out.new_text)
                    continue
                delta = choice.delta(out.new_text, out.finished)
                if delta is None and not out.finished:
                    continue
                logprobs = convert.logprobs(out, tokenizer, choice.sent_tokens, top_n)
                choice.sent_tokens = len(out.token_ids)
                finish_reason = out.finish_reason
                if out.finished and choice.called:
                    finish_reason = "tool_calls"
                yield chunk([ChunkChoice(index=index, delta=delta or Delta(), logprobs=logprobs,
                                         finish_reason=finish_reason)])  # fmt: skip
        except Exception as exc:  # the stream has started: report in-band
            yield serving.sse_error(exc)
            return
        if include_usage:
            yield chunk([], _usage(latest))
        yield "data: [DONE]\n\n"


def _usage(latest: dict[int, RequestOutput]) -> dict[str, Any] | None:
    return convert.usage(*latest.values()).model_dump(exclude_none=True) if latest else None
