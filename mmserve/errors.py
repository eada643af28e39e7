"""The MMServeError tree that the engine raises and the API maps to HTTP errors.

It knows nothing of HTTP; `api/errors.py` owns the status codes.
"""

from __future__ import annotations


class MMServeError(Exception):
    """Base of every error mmserve raises on purpose."""


class InvalidRequestError(MMServeError, ValueError):
    """The caller sent something invalid; `param` names the offending field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit the context or the KV pool."""


class EngineDeadError(MMServeError):
    """The engine loop stopped; no request can be served any more."""
