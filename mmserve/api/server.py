"""`mmserve serve`: build the engine and the app, print where they listen, run uvicorn until a signal.

SIGTERM / SIGINT drain (`DrainingServer`): new requests get 503 at once, running ones finish for up to
`shutdown_timeout_s`, then uvicorn stops (the lifespan exit aborts what is left) and the exit status
is 0. If the engine loop dies the server stops at once with exit status 1, so a supervisor restarts it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from mmserve.api.app import create_app
from mmserve.api.settings import ServerSettings
from mmserve.config import EngineArgs
from mmserve.encoders.media import MediaLimits
from mmserve.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


_DEATH_FLUSH_S = 0.5  # after the engine dies, time for handlers to send their streams' error events


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain on SIGTERM/SIGINT and an exit when the engine loop dies."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine, self.drain_timeout_s = engine, drain_timeout_s
        self.exit_code = 0
        self._drain_deadline: float | None = None
        self._death_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_deadline is not None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)  # a second signal: stop now (uvicorn's own shutdown)
            return
        # Not appended to _captured_signals: uvicorn would re-raise it after the drain, and the
        # process would die of the signal instead of exiting 0.
        logger.info("draining: refusing new requests; %d in flight", self.engine.num_in_flight)
        self.engine.drain()
        self._drain_deadline = time.monotonic() + self.drain_timeout_s

    async def on_tick(self, counter: int) -> bool:
        if self.engine.dead.is_set() and self.exit_code == 0:
            logger.critical("the engine loop died: stopping the server (exit status 1)")
            self.exit_code = 1
            # Not at once: the streams were failed on the engine thread, and each handler still has to
            # send its error event; closing now can beat it (a WebSocket then sees only code 1012).
            self._death_deadline = time.monotonic() + _DEATH_FLUSH_S
        if self._death_deadline is not None and time.monotonic() >= self._death_deadline:
            self.should_exit = True
        if self._drain_deadline is not None and (
            self.engine.num_in_flight == 0 or time.monotonic() >= self._drain_deadline
        ):
            self.should_exit = True
        return await super().on_tick(counter)


def uvicorn_config(app: Any, settings: ServerSettings, **kwargs: Any) -> uvicorn.Config:
    """The connection-level limits of `settings` (header size, keep-alive, WebSocket ping) for uvicorn."""
    return uvicorn.Config(
        app,
        http="h11",  # h11 enforces the header cap (httptools, if installed, has its own fixed one)
        h11_max_incomplete_event_size=settings.max_header_bytes,
        timeout_keep_alive=settings.keep_alive_timeout_s,
        ws_max_size=settings.max_ws_message_bytes + 1024,  # our own check answers with an error event
        ws_ping_interval=settings.ws_ping_interval_s,
        ws_ping_timeout=settings.ws_ping_interval_s,
        # Text deltas are frames of ~100 bytes: compressing each costs the server CPU for almost no
        # bytes saved (a profile of 64 streaming clients showed it on the event loop's hot path).
        ws_per_message_deflate=False,
        **kwargs,
    )


def run_server(
    engine_args: EngineArgs,
    settings: ServerSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_waiting_requests: int = 1024,
    log_level: str = "info",
    media_limits: MediaLimits | None = None,
) -> int:
    """Serves until a signal (then returns 0 after draining) or until the engine loop dies (returns 1)."""
    engine = AsyncEngine(engine_args, max_waiting_requests=max_waiting_requests, media_limits=media_limits)
    app = create_app(engine, settings, own_engine=True)
    shown = f"[{host}]" if ":" in host else host
    base = f"http://{shown}:{port}"
    auth = "API key required (Authorization: Bearer ...)" if settings.api_key else "no API key"
    print(
        f"mmserve: serving {engine.model_name} as {app.state.mm.model_name!r} at {base}  ({auth})\n"
        f"  OpenAI base_url: {base}/v1    WebSocket chat: ws://{shown}:{port}/v1/chat/ws    "
        f"metrics: {base}/metrics\n  uploads stored in {settings.data_dir}",
        flush=True,
    )
    config = uvicorn_config(
        app,
        settings,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 1,
    )
    server = DrainingServer(config, engine, settings.shutdown_timeout_s)
    server.run()
    return server.exit_code


class ServerThread:
    """An app served by uvicorn in a daemon thread (tests, `bench serve`); port 0 lets the OS pick.

    `start()` again after `stop()` serves on the same port, as a restarted server would.
    """

    def __init__(
        self, app_factory: Callable[[], Any], *, port: int = 0, ws_max_size: int | None = None
    ) -> None:
        self.app_factory, self.port, self.ws_max_size = app_factory, port, ws_max_size
        self.start()

    def start(self, timeout: float = 60.0) -> None:
        app = self.app_factory()
        state = app.state.mm
        config = uvicorn_config(app, state.settings, host="127.0.0.1", port=self.port, log_level="warning")
        config.ws_max_size = self.ws_max_size or 16 * 2**20  # uvicorn's default, as before
        self.server = DrainingServer(config, state.engine, state.settings.shutdown_timeout_s)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/v1/chat/ws"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
