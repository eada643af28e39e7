"""Typed (pydantic) objects the SDK returns: chat completions and chunks, files, models, session results.

Every model allows extra fields so a newer server never breaks an older SDK.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict

# OpenAI's service tiers: "flex" runs as batch work, the others as interactive (server policy `slo`).
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class SLOTargets(TypedDict, total=False):
    """A request's own latency targets in milliseconds (mmserve extension); each overrides the server's
    default for the request's class."""

    ttft_ms: float  # arrival -> first token
    tbt_ms: float  # between two output tokens
    deadline_ms: float  # arrival -> last token


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(_Model):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Model):
    content: list[TokenLogprob] | None = None


class ChatCompletionMessage(_Model):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = []  # OpenAI's shape: {"id", "type": "function", "function": {...}}


class Choice(_Model):
    index: int = 0
    message: ChatCompletionMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Model):
    id: str
    object: str = "chat.completion"
    created: int = 0
    model: str = ""
    choices: list[Choice]
    usage: Usage | None = None
    service_tier: str | None = None  # the tier it was served in ("flex": the batch class)


class ChoiceDelta(_Model):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # streamed fragments: {"index", "id"?, "function": {...}}


class ChunkChoice(_Model):
    index: int = 0
    delta: ChoiceDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Model):
    id: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str = ""
    choices: list[ChunkChoice] = []
    # Only on the final chunk when `stream_options={"include_usage": True}` (its `choices` is empty).
    usage: Usage | None = None
    service_tier: str | None = None  # on every chunk: the tier it is served in


class FileObject(_Model):
    id: str
    object: str = "file"
    bytes: int
    created_at: int
    filename: str | None = None
    purpose: str | None = None
    media_type: str | None = None  # "image" or "video", decided by the server from the content
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None  # video only
    duration_s: float | None = None  # video only
    fps: float | None = None  # video only


class FileList(_Model):
    object: str = "list"
    data: list[FileObject]


class FileDeleted(_Model):
    id: str
    object: str = "file"
    deleted: bool


class Model(_Model):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = ""


class ModelList(_Model):
    object: str = "list"
    data: list[Model]


class ResponseMetrics(_Model):
    ttft_ms: float | None = None
    tokens_per_s: float | None = None


ResponseStatus = Literal["in_progress", "completed", "cancelled", "failed", "incomplete"]


class SessionResult(_Model):
    """The `response` object of a WebSocket `response.done` event."""

    id: str
    status: ResponseStatus
    output_text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    metrics: ResponseMetrics | None = None
    error: dict[str, Any] | None = None
    service_tier: str | None = None  # the tier it was served in ("flex": the batch class)
