"""`mmserve serve`: build the engine and the app, print where they listen, run uvicorn until a signal.

uvicorn's graceful shutdown runs the app's lifespan exit, which drains and stops the engine.
"""

from __future__ import annotations

import uvicorn

from mmserve.api.app import create_app
from mmserve.api.settings import ServerSettings
from mmserve.config import EngineArgs
from mmserve.engine.async_engine import AsyncEngine


def run_server(
    engine_args: EngineArgs,
    settings: ServerSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_waiting_requests: int = 1024,
    log_level: str = "info",
) -> None:
    engine = AsyncEngine(engine_args, max_waiting_requests=max_waiting_requests)
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
