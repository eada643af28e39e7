"""`Client` / `AsyncClient`: the SDK's entry points, wiring one transport to the chat, files and models resources."""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

import httpx

from mmserve.client._base import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    AsyncTransport,
    SyncTransport,
    TimeoutTypes,
    parse_json,
)
from mmserve.client.chat import AsyncChat, Chat
from mmserve.client.files import AsyncFiles, Files
from mmserve.client.types import ModelList


class Models:
    def __init__(self, transport: SyncTransport) -> None:
        self._transport = transport

    def list(self) -> ModelList:
        return ModelList.model_validate(parse_json(self._transport.request("GET", "/v1/models")))


class AsyncModels:
    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def list(self) -> ModelList:
        return ModelList.model_validate(parse_json(await self._transport.request("GET", "/v1/models")))


class Client:
    """Synchronous client: `chat.completions.create`, `chat.session()`, `files`, `models`, `health()`.

    `base_url` is the server root (`http://127.0.0.1:8000`; a trailing `/v1` is accepted too). `api_key`
    defaults to the `MMSERVE_API_KEY` environment variable (as the server's own default).
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: TimeoutTypes = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        http_client: httpx.Client | None = None,
    ) -> None:
        api_key = api_key if api_key is not None else os.environ.get("MMSERVE_API_KEY")
        self._transport = SyncTransport(base_url, api_key, timeout, max_retries, http_client)
        self.base_url = self._transport.base_url
        self.chat = Chat(self._transport)
        self.files = Files(self._transport)
        self.models = Models(self._transport)

    def health(self) -> Any:
        """GET /health: the parsed JSON body (or text); raises an APIError when the server is unhealthy."""
        response = self._transport.request("GET", "/health")
        try:
            return response.json()
        except ValueError:
            return response.text

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient:
    """Async twin of `Client` (every call is awaited; `async with` closes it)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        api_key: str | None = None,
        timeout: TimeoutTypes = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        api_key = api_key if api_key is not None else os.environ.get("MMSERVE_API_KEY")
        self._transport = AsyncTransport(base_url, api_key, timeout, max_retries, http_client)
        self.base_url = self._transport.base_url
        self.chat = AsyncChat(self._transport)
        self.files = AsyncFiles(self._transport)
        self.models = AsyncModels(self._transport)

    async def health(self) -> Any:
        response = await self._transport.request("GET", "/health")
        try:
            return response.json()
        except ValueError:
            return response.text

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
