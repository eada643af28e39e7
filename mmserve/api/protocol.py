"""Wire types of the HTTP and WebSocket API (pydantic v2), shared with the SDK. Requests ignore unknown
fields (as vLLM does) but refuse known OpenAI features mmserve lacks (`n > 1`). Knows nothing of the engine."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# ------------------------------------------------------------------------------------ content parts


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")


class URLRef(_Part):
    url: str  # data URL, uploaded file id, allowed local path or allow-listed http(s) URL
    detail: str | None = None  # accepted for OpenAI compatibility; ignored


class FileRef(_Part):
    file_id: str


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageURLPart(_Part):
    type: Literal["image_url"]
    image_url: URLRef


class VideoURLPart(_Part):
    type: Literal["video_url"]
    video_url: URLRef


class FilePart(_Part):
    type: Literal["file"]
    file: FileRef


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart | FilePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None


# --------------------------------------------------------------------------------- sampling fields


class SLOSpec(BaseModel):
    """A request's own latency targets in milliseconds (mmserve extension); each given one overrides the
    server's default for the request's class. Unknown keys are refused: a misspelt target would
    otherwise be dropped without a word."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(default=None, gt=0.0, lt=1e9)  # arrival -> first token
    tbt_ms: float | None = Field(default=None, gt=0.0, lt=1e9)  # between two output tokens
    deadline_ms: float | None = Field(default=None, gt=0.0, lt=1e9)  # arrival -> last token


# OpenAI's service tiers. "flex" -> the batch class; the others (and no tier) -> interactive.
ServiceTier = Literal["auto", "default", "flex", "priority"]


class SamplingFields(BaseModel):
    """The sampling knobs shared by chat completions and WebSocket `response.create`."""

    model_config = ConfigDict(extra="ignore")

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    # mmserve extensions
    top_k: int | None = Field(default=None, ge=-1)  # None, 0 or -1: off
    ignore_eos: bool = False
    priority: int = 0  # smaller first under --scheduler-policy priority
    # Service class and SLO (acted on by --scheduler-policy slo): OpenAI's field, and mmserve's targets.
    service_tier: ServiceTier | None = None
    slo: SLOSpec | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(SamplingFields):
    model: str | None = None  # any value is served by the one loaded model
    max_completion_tokens: int | None = Field(default=None, ge=1)  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None  # accepted, ignored


# ------------------------------------------------------------------------------ chat completions out


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    service_tier: ServiceTier | None = None  # the tier the request was served in ("flex": batch class)


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    service_tier: ServiceTier | None = None  # on every chunk, as OpenAI does


# --------------------------------------------------------------------------------------- models, files


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mmserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    media_type: Literal["image", "video"]
    width: int
    height: int
    num_frames: int | None = None  # video only
    duration_s: float | None = None  # video only
    fps: float | None = None  # video only
    sha256: str


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


# ------------------------------------------------------------------------------------------ errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ------------------------------------------------------------------------------- WebSocket events


class ResponseParams(SamplingFields):
    id: str | None = Field(default=None, min_length=1, max_length=128)


class ResponseCreateEvent(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["response.create"]
    event_id: str | None = None
    response: ResponseParams


class ResponseCancelEvent(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["response.cancel"]
    event_id: str | None = None
    response_id: str


ClientEvent = Annotated[ResponseCreateEvent | ResponseCancelEvent, Field(discriminator="type")]

ResponseStatus = Literal["in_progress", "completed", "cancelled", "failed", "incomplete"]


class ResponseMetrics(BaseModel):
    ttft_ms: float | None  # arrival -> first token
    tokens_per_s: float | None  # completion tokens / (finish - arrival)


class ResponseObject(BaseModel):
    id: str
    status: ResponseStatus
    output_text: str | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    metrics: ResponseMetrics | None = None
    error: ErrorInfo | None = None  # set when status is "failed"
    incomplete_details: dict[str, str] | None = None  # status "incomplete" by the server: {"reason": ...}
    service_tier: ServiceTier | None = None  # on response.done: the tier it was served in


def response_event(kind: str, response: ResponseObject) -> dict[str, Any]:
    """`session.created` aside, server events are dicts: {"type", ...payload}."""
    return {"type": kind, "response": response.model_dump(exclude_none=True)}
