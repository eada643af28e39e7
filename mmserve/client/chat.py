"""`client.chat`: chat completions over HTTP (JSON or SSE stream) and the WebSocket `session()` factory.

Builds the request body (None parameters are left out, so the server's defaults apply); the transport
owns retries and errors, `streaming.py` owns SSE, `session.py` / `async_session.py` own the WebSocket.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypedDict, overload

from mmserve.client._base import NOT_GIVEN, AsyncTransport, SyncTransport, TimeoutTypes, parse_json
from mmserve.client.async_session import AsyncChatSession
from mmserve.client.session import ChatSession
from mmserve.client.streaming import AsyncStream, Stream
from mmserve.client.types import ChatCompletion, ServiceTier, SLOTargets

if TYPE_CHECKING:
    from typing_extensions import Unpack

Messages = Iterable[Mapping[str, Any]]


class ChatParams(TypedDict, total=False):
    """Optional `create()` parameters; each maps to the body field of the same name (None: left out)."""

    model: str | None  # None: the server's one model
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: str | list[str] | None
    logprobs: bool | None
    top_logprobs: int | None
    top_k: int | None  # mmserve extension
    ignore_eos: bool | None  # mmserve extension
    priority: int | None  # mmserve extension (smaller runs first under the priority policy)
    # OpenAI's tier: "flex" runs as batch work, anything else as interactive (under the slo policy).
    service_tier: ServiceTier | None
    slo: SLOTargets | Mapping[str, float] | None  # mmserve extension: this request's own latency targets
    max_completion_tokens: int | None
    n: int | None  # choices per request (choices[i].index)
    presence_penalty: float | None
    frequency_penalty: float | None
    logit_bias: Mapping[str, float] | None  # {"token id": bias in [-100, 100]}
    repetition_penalty: float | None  # vLLM extension
    min_tokens: int | None  # vLLM extension
    stop_token_ids: list[int] | None  # vLLM extension
    bad_words: list[str] | None  # vLLM extension
    response_format: Mapping[str, Any] | None  # {"type": "json_object"} or {"type": "json_schema", ...}
    structured_outputs: Mapping[str, Any] | None  # vLLM: {json | regex | choice | grammar | json_object}
    tools: list[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None  # "auto" | "none" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None
    add_generation_prompt: bool | None  # chat template options (vLLM's)
    continue_final_message: bool | None
    chat_template: str | None
    chat_template_kwargs: Mapping[str, Any] | None
    stream_options: Mapping[str, Any] | None  # e.g. {"include_usage": True}
    extra_body: Mapping[str, Any] | None  # merged into the body last (fields this SDK does not know)
    timeout: TimeoutTypes  # this call only; default: the client's


def build_chat_body(messages: Messages, stream: bool, params: ChatParams) -> dict[str, Any]:
    unknown = set(params) - set(ChatParams.__annotations__)
    if unknown:
        raise TypeError(f"create() got unexpected keyword arguments {sorted(unknown)}")
    body: dict[str, Any] = {"messages": [dict(m) for m in messages]}
    for key, value in params.items():
        if value is not None and key not in ("extra_body", "timeout"):
            body[key] = dict(value) if isinstance(value, Mapping) else value
    if stream:
        body["stream"] = True
    body.update(params.get("extra_body") or {})
    return body


class Completions:
    def __init__(self, transport: SyncTransport) -> None:
        self._transport = transport

    @overload
    def create(
        self, *, messages: Messages, stream: Literal[False] = ..., **params: Unpack[ChatParams]
    ) -> ChatCompletion: ...
    @overload
    def create(
        self, *, messages: Messages, stream: Literal[True], **params: Unpack[ChatParams]
    ) -> Stream: ...

    def create(
        self, *, messages: Messages, stream: bool = False, **params: Unpack[ChatParams]
    ) -> ChatCompletion | Stream:
        """POST /v1/chat/completions: a `ChatCompletion`, or with `stream=True` a `Stream` of chunks."""
        body = build_chat_body(messages, stream, params)
        response = self._transport.request(
            "POST", "/v1/chat/completions", json=body, timeout=params.get("timeout", NOT_GIVEN),
            headers={"Accept": "text/event-stream"} if stream else None, stream=stream,
        )  # fmt: skip
        if stream:
            return Stream(response)
        return ChatCompletion.model_validate(parse_json(response))


class AsyncCompletions:
    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    @overload
    async def create(
        self, *, messages: Messages, stream: Literal[False] = ..., **params: Unpack[ChatParams]
    ) -> ChatCompletion: ...
    @overload
    async def create(
        self, *, messages: Messages, stream: Literal[True], **params: Unpack[ChatParams]
    ) -> AsyncStream: ...

    async def create(
        self, *, messages: Messages, stream: bool = False, **params: Unpack[ChatParams]
    ) -> ChatCompletion | AsyncStream:
        """Async twin of `Completions.create`."""
        body = build_chat_body(messages, stream, params)
        response = await self._transport.request(
            "POST", "/v1/chat/completions", json=body, timeout=params.get("timeout", NOT_GIVEN),
            headers={"Accept": "text/event-stream"} if stream else None, stream=stream,
        )  # fmt: skip
        if stream:
            return AsyncStream(response)
        return ChatCompletion.model_validate(parse_json(response))


class Chat:
    def __init__(self, transport: SyncTransport) -> None:
        self._transport = transport
        self.completions = Completions(transport)

    def session(self, *, open_timeout: float | None = 10.0) -> ChatSession:
        """A WebSocket chat session on /v1/chat/ws; use as a context manager (it connects on enter)."""
        return ChatSession(self._transport.base_url, self._transport.api_key, open_timeout=open_timeout)


class AsyncChat:
    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport
        self.completions = AsyncCompletions(transport)

    def session(self, *, open_timeout: float | None = 10.0) -> AsyncChatSession:
        """Async WebSocket chat session; `async with client.chat.session() as s:`."""
        return AsyncChatSession(self._transport.base_url, self._transport.api_key, open_timeout=open_timeout)
