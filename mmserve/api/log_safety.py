"""Keeps secrets out of the server's logs: uvicorn logs each WebSocket handshake's path with its query
string, where browsers put `?api_key=`; this filter masks the value. Prompts and media are never
logged by mmserve itself (request ids and sizes only)."""

from __future__ import annotations

import logging
import re

_SECRET_PARAM = re.compile(r"((?:^|[?&])api_key=)[^&\s\"]*", re.IGNORECASE)
_LOGGERS = ("uvicorn.access", "uvicorn.error")


def redact(text: str) -> str:
    return _SECRET_PARAM.sub(r"\1***", text)


class RedactSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True


def install() -> None:
    """Idempotent: one filter per uvicorn logger."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())
