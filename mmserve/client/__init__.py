"""mmserve's Python SDK: `Client` / `AsyncClient` (HTTP + WebSocket), typed results, errors, media helpers.

Shaped like openai-python: `client.chat.completions.create(...)`, `client.files.create(...)`, and the
same error classes. Talks only the public wire protocol; imports nothing from the server or engine.
"""

from mmserve.client.async_session import AsyncChatSession, AsyncSessionResponse
from mmserve.client.client import AsyncClient, Client
from mmserve.client.errors import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    UnprocessableEntityError,
    UnsupportedMediaTypeError,
)
from mmserve.client.media import avideo_part, image_part, video_part
from mmserve.client.session import ChatSession, SessionResponse
from mmserve.client.streaming import AsyncStream, Stream
from mmserve.client.types import (
    ChatCompletion,
    ChatCompletionChunk,
    FileDeleted,
    FileList,
    FileObject,
    ModelList,
    ServiceTier,
    SessionResult,
    SLOTargets,
    Usage,
)

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncChatSession",
    "AsyncClient",
    "AsyncSessionResponse",
    "AsyncStream",
    "AuthenticationError",
    "BadRequestError",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatSession",
    "Client",
    "ConflictError",
    "FileDeleted",
    "FileList",
    "FileObject",
    "InternalServerError",
    "ModelList",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTooLargeError",
    "SLOTargets",
    "ServiceTier",
    "SessionResponse",
    "SessionResult",
    "Stream",
    "UnprocessableEntityError",
    "UnsupportedMediaTypeError",
    "Usage",
    "avideo_part",
    "image_part",
    "video_part",
]
