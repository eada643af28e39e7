"""HTTP transport for the SDK: one httpx client (sync or async), auth headers, error mapping, retries.

Retries (exponential backoff with jitter, `Retry-After` honoured but capped) cover connection errors,
timeouts, 408, 429 and 5xx, and only happen before a response is handed back: a stream that has
been returned to the caller is never retried. Knows no endpoint.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from mmserve.client.errors import APIConnectionError, APIError, APIStatusError, APITimeoutError, status_error

DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
DEFAULT_MAX_RETRIES = 2
INITIAL_RETRY_DELAY = 0.5  # seconds; doubles each attempt
MAX_RETRY_DELAY = 8.0
MAX_RETRY_AFTER = 60.0  # a server's Retry-After beyond this is capped, never obeyed blindly
USER_AGENT = "mmserve-client/0.1"

# `timeout=` not given on a call -> the client's default (None would mean "no timeout").
NOT_GIVEN: Any = httpx.USE_CLIENT_DEFAULT

TimeoutTypes = float | httpx.Timeout | None
# A multipart `files=` value, or a callable that builds one per attempt (so a retry re-reads a file).
FilesArg = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None


def normalize_base_url(base_url: str) -> str:
    """`http://host:8000/v1/` -> `http://host:8000`: endpoint paths below all start with `/v1` or `/health`."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def should_retry(err: APIStatusError) -> bool:
    """408, 429 and 5xx are retried, except a 429 the server sent without `Retry-After` because no retry
    could succeed (admission control's `slo_infeasible` for a target the request cannot meet even alone)."""
    if err.status_code == 429 and err.code == "slo_infeasible" and err.retry_after is None:
        return False
    return err.status_code in (408, 429) or err.status_code >= 500


def retry_delay(attempt: int, retry_after: float | None) -> float:
    """Seconds to wait before retry number `attempt + 1` (attempt counts from 0)."""
    if retry_after is not None:
        return min(retry_after, MAX_RETRY_AFTER)
    delay = min(INITIAL_RETRY_DELAY * 2.0**attempt, MAX_RETRY_DELAY)
    return delay * (1.0 - 0.25 * random.random())  # jitter: spread retries of many clients apart


# Module-level so tests can replace them and record the delays instead of sleeping.
def _sleep(seconds: float) -> None:
    time.sleep(seconds)


async def _asleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


def default_headers(api_key: str | None) -> dict[str, str]:
    headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _transport_error(exc: httpx.TransportError) -> APIConnectionError:
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError()
    return APIConnectionError(f"Connection error: {exc}")


def parse_json(response: httpx.Response) -> Any:
    """The JSON body of a successful response; a non-JSON body is an APIError, not a ValueError."""
    try:
        return response.json()
    except ValueError as exc:
        raise APIError(
            f"Expected JSON from {response.request.url.path}, got {response.text[:200]!r}",
            request_id=response.headers.get("x-request-id"),
        ) from exc


class _TransportBase:
    def __init__(self, base_url: str, api_key: str | None, timeout: TimeoutTypes, max_retries: int) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.base_url = normalize_base_url(base_url)
        self.api_key = api_key
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.max_retries = max_retries
        self.headers = default_headers(api_key)

    def _build(
        self,
        http: httpx.Client | httpx.AsyncClient,
        method: str,
        path: str,
        json: Any,
        files: FilesArg,
        data: Mapping[str, Any] | None,
        params: Mapping[str, Any] | None,
        timeout: Any,
        headers: Mapping[str, str] | None,
    ) -> httpx.Request:
        return http.build_request(
            method,
            path,
            json=json,
            files=files() if callable(files) else files,
            data=data,
            params=params,
            timeout=timeout,
            headers=headers,
        )


class SyncTransport(_TransportBase):
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: TimeoutTypes = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(base_url, api_key, timeout, max_retries)
        self.http = http_client or httpx.Client(
            base_url=self.base_url, headers=self.headers, timeout=self.timeout
        )

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        files: FilesArg = None,
        data: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        timeout: Any = NOT_GIVEN,
        headers: Mapping[str, str] | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """Send with retries; returns a 2xx response (unread if `stream`) or raises an APIError."""
        attempt = 0
        while True:
            request = self._build(self.http, method, path, json, files, data, params, timeout, headers)
            try:
                response = self.http.send(request, stream=stream)
            except httpx.TransportError as exc:
                err: APIError = _transport_error(exc)
                cause: BaseException = exc
            else:
                if response.is_success:
                    return response
                body = response.read()
                response.close()
                err = cause = status_error(response.status_code, body, response.headers, response)
                if not should_retry(err):
                    raise err
            if attempt >= self.max_retries:
                raise err from (cause if cause is not err else None)
            _sleep(retry_delay(attempt, getattr(err, "retry_after", None)))
            attempt += 1

    def close(self) -> None:
        self.http.close()


class AsyncTransport(_TransportBase):
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: TimeoutTypes = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(base_url, api_key, timeout, max_retries)
        self.http = http_client or httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers, timeout=self.timeout
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        files: FilesArg = None,
        data: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        timeout: Any = NOT_GIVEN,
        headers: Mapping[str, str] | None = None,
        stream: bool = False,
    ) -> httpx.Response:
        """Async twin of `SyncTransport.request`."""
        attempt = 0
        while True:
            request = self._build(self.http, method, path, json, files, data, params, timeout, headers)
            try:
                response = await self.http.send(request, stream=stream)
            except httpx.TransportError as exc:
                err: APIError = _transport_error(exc)
                cause: BaseException = exc
            else:
                if response.is_success:
                    return response
                body = await response.aread()
                await response.aclose()
                err = cause = status_error(response.status_code, body, response.headers, response)
                if not should_retry(err):
                    raise err
            if attempt >= self.max_retries:
                raise err from (cause if cause is not err else None)
            await _asleep(retry_delay(attempt, getattr(err, "retry_after", None)))
            attempt += 1

    async def close(self) -> None:
        await self.http.aclose()
