"""Wire types of the HTTP and WebSocket API (pydantic v2), shared with the SDK. Requests ignore unknown
fields (as vLLM does); OpenAI fields mmserve does not implement are declared here so that the routes can
refuse them by name (`unsupported_fields`). Knows nothing of the engine."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
PART_TYPES = ("text", "image_url", "video_url", "file")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant turn."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns (content may then be null)
    tool_call_id: str | None = None  # role "tool": the call this message answers

    @field_validator("content", mode="before")
    @classmethod
    def _known_part_types(cls, value: Any) -> Any:
        """Names an unknown part type and lists the valid ones (pydantic's union error names neither)."""
        if isinstance(value, list):
            for i, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in PART_TYPES:
                    raise ValueError(
                        f"part {i}: unknown content part type {kind!r}; expected one of {', '.join(PART_TYPES)}"
                    )
        return value


# --------------------------------------------------------------------------------- sampling fields


class SLOSpec(BaseModel):
    """A request's own latency targets in milliseconds (mmserve extension); each given one overrides the
    server's default for the request's class. Unknown keys are refused: a misspelt target would
    otherwise be dropped without a word."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(default=None, gt=0.0, lt=1e9)  # arrival -> first token
    tbt_ms: float | None = Field(default=None, gt=0.0, lt=1e9)  # between two output tokens
    deadline_ms: float | None = Field(default=None, gt=0.0, lt=1e9)  # arrival -> last token


# OpenAI's service tiers (every value the openai SDK sends). "flex" -> the batch class; the others (and no
# tier) -> interactive.
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsSpec(BaseModel):
    """vLLM's `structured_outputs` extension: one of these constrains the output."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(BaseModel):
    """The sampling knobs shared by chat completions, completions and WebSocket `response.create`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1  # range checked by SamplingParams (a 400 naming `n`)
    presence_penalty: float | None = None  # ranges checked by SamplingParams (400s naming the field)
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string: a JSON key) -> bias in [-100, 100]
    # vLLM's extensions
    top_k: int | None = Field(default=None, ge=-1)  # None, 0 or -1: off
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    structured_outputs: StructuredOutputsSpec | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for structured_outputs.*
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # mmserve extensions
    priority: int = 0  # smaller first under --scheduler-policy priority
    # Service class and SLO (acted on by --scheduler-policy slo): OpenAI's field, and mmserve's targets.
    service_tier: ServiceTier | None = None
    slo: SLOSpec | None = None
    # OpenAI fields that change the output but are not implemented: refused by name (`unsupported_fields`).
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    modalities: list[str] | None = None
    # Accepted and harmless: nothing of the output depends on them.
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class ChatFields(SamplingFields):
    """What chat completions and WebSocket `response.create` share beyond sampling: the conversation, tools,
    the output format and the chat template's options."""

    messages: list[ChatMessage] = Field(min_length=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None
    # Chat template options (vLLM's): continue_final_message renders the last (assistant) message open.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    functions: Any = None  # OpenAI's legacy function calling: refused (use tools)
    function_call: Any = None


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class ChatCompletionRequest(ChatFields):
    model: str | None = None  # a served model name (--served-model-name); None: the first one
    max_completion_tokens: int | None = Field(default=None, ge=1)  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's prefill/decode disaggregation (checked by KVTransferParams: a 400 naming the field).
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: `prompt` is text, token ids, or a list of either (several prompts)."""

    model: str | None = None
    prompt: str | list[int] | list[str | list[int]]
    echo: bool = False
    logprobs: int | None = None  # 0..20 (checked by the route: a 400)
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None  # refused
    best_of: int | None = None  # only 1 (or n)
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's prefill/decode disaggregation


def unsupported_fields(body: BaseModel) -> list[str]:
    """The OpenAI fields of `body` that would change the output but that mmserve does not implement."""
    bad = [name for name in ("audio", "prediction", "web_search_options", "functions", "function_call")
           if getattr(body, name, None) is not None]  # fmt: skip
    modalities = getattr(body, "modalities", None)
    if modalities is not None and any(m != "text" for m in modalities):
        bad.append("modalities")
    if getattr(body, "suffix", None):
        bad.append("suffix")
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != getattr(body, "n", 1) and best_of > 1:
        bad.append("best_of")
    return bad


# ------------------------------------------------------------------------------ chat completions out


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


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
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's answer to do_remote_decode


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """OpenAI's streamed tool call: the first delta of a call has its id, type and name; later ones add to
    its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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


# ---------------------------------------------------------------------------------------- completions


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: per token its text, logprob, the top alternatives and its offset."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's answer to do_remote_decode


# ------------------------------------------------------------------------------- tokenize, detokenize


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a `prompt`, or `messages` rendered by the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


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


class ResponseParams(ChatFields):
    id: str | None = Field(default=None, min_length=1, max_length=128)
    kv_transfer_params: dict[str, Any] | None = None  # refused: disaggregation is vLLM's HTTP protocol


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
    tool_calls: list[ToolCallOut] | None = None  # calls read out of the output (with `tools`)
    finish_reason: str | None = None
    usage: Usage | None = None
    metrics: ResponseMetrics | None = None
    error: ErrorInfo | None = None  # set when status is "failed"
    incomplete_details: dict[str, str] | None = None  # status "incomplete" by the server: {"reason": ...}
    service_tier: ServiceTier | None = None  # on response.done: the tier it was served in


def response_event(kind: str, response: ResponseObject) -> dict[str, Any]:
    """`session.created` aside, server events are dicts: {"type", ...payload}."""
    return {"type": kind, "response": response.model_dump(exclude_none=True)}
