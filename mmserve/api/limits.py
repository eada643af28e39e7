"""Per-API-key concurrency limit: how many requests one key may have in progress at once (HTTP chat
completions and WebSocket responses together); beyond it, 429 with Retry-After. Knows nothing of routes."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from mmserve.api.errors import APIError

T = TypeVar("T")
ANONYMOUS = "anonymous"  # the one bucket of every client that sends no key (a server without auth)


def key_id(given: str | None) -> str:
    """A bucket name for a presented key; a digest, so the secret itself is never kept or logged."""
    if not given:
        return ANONYMOUS
    return hashlib.sha256(given.encode()).hexdigest()[:16]


def bearer(authorization: str | None, query_key: str | None = None) -> str | None:
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return query_key


class ConcurrencyLimiter:
    """Counts requests in progress per key. `acquire` returns an idempotent release function."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit  # None: unlimited (still counted, for tests and the soak report)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def in_progress(self, key: str | None = None) -> int:
        with self._lock:
            return self._counts.get(key, 0) if key is not None else sum(self._counts.values())

    def acquire(self, key: str) -> Callable[[], None]:
        with self._lock:
            count = self._counts.get(key, 0)
            if self.limit is not None and count >= self.limit:
                raise APIError(
                    429,
                    f"this API key already has {count} requests in progress "
                    f"(max_concurrent_requests_per_key={self.limit})",
                    code="too_many_concurrent_requests",
                    headers={"Retry-After": "1"},
                )
            self._counts[key] = count + 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                left = self._counts[key] - 1
                if left:
                    self._counts[key] = left
                else:
                    del self._counts[key]

        return release


async def release_at_end(stream: AsyncIterator[T], release: Callable[[], None]) -> AsyncIterator[T]:
    """`stream`, releasing the slot when it ends, fails or is closed (and closing `stream` then)."""
    try:
        async for item in stream:
            yield item
    finally:
        release()
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
