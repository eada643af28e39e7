"""`mmserve serve`: build the engine and the app, print where they listen, run uvicorn until a signal.

uvicorn's graceful shutdown runs the app's lifespan exit, which drains and stops the engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from mmserve.api.app import create_app
from mmserve.api.settings import ServerSettings
from mmserve.config import EngineArgs
from mmserve.encoders.media import MediaLimits
from mmserve.engine.async_engine import AsyncEngine


def run_server(
    engine_args: EngineArgs,
    settings: ServerSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_waiting_requests: int = 1024,
    log_level: str = "info",
    media_limits: MediaLimits | None = None,
) -> None:
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
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        ws_max_size=settings.max_ws_message_bytes + 1024,  # our own check answers with an error event
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 1,
    )


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
        kwargs = {"ws_max_size": self.ws_max_size} if self.ws_max_size else {}
        config = uvicorn.Config(
            self.app_factory(), host="127.0.0.1", port=self.port, log_level="warning", **kwargs
        )
        self.server = uvicorn.Server(config)
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
