"""`create_app(engine, settings)`: the FastAPI app — shared state, auth, body caps, /health, /v1/models,
/metrics, and the routers of chat completions, completions, tokenize, WebSocket chat and files."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.types import Scope

from mmserve.api import log_safety
from mmserve.api.body_limit import BodySizeLimit, HeaderSizeLimit
from mmserve.api.errors import APIError, install_error_handlers
from mmserve.api.limits import ConcurrencyLimiter
from mmserve.api.media_refs import MediaResolver
from mmserve.api.media_store import MediaStore
from mmserve.api.metrics import MetricsExporter
from mmserve.api.protocol import ModelCard, ModelList
from mmserve.api.settings import MiB, ServerSettings
from mmserve.encoders.decode_pool import DecodePool
from mmserve.encoders.media import DEFAULT_LIMITS
from mmserve.engine.async_engine import AsyncEngine
from mmserve.gc_heap import startup_heap_frozen


@dataclass(eq=False)
class ServerState:
    """What every route needs; lives on `app.state.mm`."""

    engine: AsyncEngine
    settings: ServerSettings
    model_name: str
    store: MediaStore
    resolver: MediaResolver
    metrics: MetricsExporter
    started: int  # unix time
    limiter: ConcurrencyLimiter  # requests in progress per API key
    model_names: tuple[str, ...] = ()  # every name `model` may hold; model_name (echoed) is the first
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # the checkpoint's sampling defaults

    def check_model(self, name: str | None) -> None:
        """A request's `model` must name a served model (None: the default one); otherwise 404."""
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist (served: {', '.join(self.model_names)})",
                           code="model_not_found", param="model", type="invalid_request_error")  # fmt: skip

    def model_card(self, name: str) -> ModelCard:
        return ModelCard(id=name, created=self.started, max_model_len=self.engine.max_model_len)


def get_state(request: Request) -> ServerState:
    return request.app.state.mm


State = Annotated[ServerState, Depends(get_state)]  # route parameter type


def check_api_key(settings: ServerSettings, authorization: str | None, query_key: str | None = None) -> bool:
    if settings.api_key is None:
        return True
    given = query_key
    if authorization and authorization[:7].lower() == "bearer ":
        given = authorization[7:].strip()
    return given is not None and hmac.compare_digest(given.encode(), settings.api_key.encode())


async def require_api_key(request: Request) -> None:
    if not check_api_key(get_state(request).settings, request.headers.get("authorization")):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                       code="invalid_api_key")  # fmt: skip


def create_app(
    engine: AsyncEngine, settings: ServerSettings | None = None, *, own_engine: bool = False
) -> FastAPI:
    """`own_engine`: shut the engine down (draining for `shutdown_timeout_s`) when the app stops."""
    from mmserve.api import (  # routers import get_state from here
        chat_ws,
        completions_routes,
        convert,
        files,
        openai_routes,
        page,
        tokenize_routes,
    )

    settings = settings or ServerSettings()
    log_safety.install()  # no ?api_key= in uvicorn's handshake log lines
    model_names = settings.model_names or (engine.model_name,)
    model_name = model_names[0]
    mm = engine.processor.mm_processor
    limits = mm.limits if mm is not None else DEFAULT_LIMITS
    # One pool of decode workers for chat media and upload validation (a text-only model gets its own).
    decoder = mm.decoder if mm is not None else DecodePool.for_limits(limits)
    store = MediaStore(
        settings.data_dir, limits, settings.max_image_upload_bytes, settings.max_video_upload_bytes, decoder
    )
    vllm_cache_config = None
    if settings.vllm_metric_names:  # vLLM's label names and spellings (str(True) is "True")
        vllm_cache_config = {
            "block_size": str(engine.info.block_size),
            "num_gpu_blocks": str(engine.info.num_kv_blocks),
            "num_cpu_blocks": "0",
            "enable_prefix_caching": str(engine.args.enable_prefix_caching),
            "cache_dtype": engine.args.kv_cache_dtype,
            "prefix_caching_hash_algo": "sha256",
        }
    metrics = MetricsExporter(engine.stats, model_name, vllm_cache_config, engine.info)
    engine.stat_loggers.append(metrics)
    state = ServerState(engine, settings, model_name, store, MediaResolver(store, settings), metrics,
                        int(time.time()), ConcurrencyLimiter(settings.max_concurrent_requests_per_key), model_names,
                        convert.generation_defaults(engine.args.model) if settings.generation_config == "auto"
                        else {})  # fmt: skip

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(decoder.start)  # workers ready before the first request
        try:
            with startup_heap_frozen("api server"):  # a full collection mid-stream scans only what serving made
                yield
        finally:
            if metrics in engine.stat_loggers:
                engine.stat_loggers.remove(metrics)
            if own_engine:
                await engine.shutdown(settings.shutdown_timeout_s)
            # Every worker is stopped and reaped; an engine that outlives this app respawns on demand.
            await asyncio.to_thread(decoder.close)

    app = FastAPI(title="mmserve", version="0.1.0", lifespan=lifespan)
    app.state.mm = state
    install_error_handlers(app)

    def body_limit(scope: Scope) -> int:
        if scope.get("path") == "/v1/files":
            return (
                settings.max_upload_bytes + MiB
            )  # multipart framing; each kind's cap is checked in the store
        return settings.max_body_bytes

    app.add_middleware(BodySizeLimit, limit_for=body_limit)
    app.add_middleware(HeaderSizeLimit, limit=settings.max_header_bytes)
    if settings.cors_allow_origins:  # off by default: no Access-Control-* header is ever sent
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_allow_origins),
            allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )

    @app.get("/health")
    async def health() -> Response:
        """Readiness: 200 while new requests are taken; 503 once draining or the engine is gone."""
        if not engine.is_running:
            return APIError(503, "the engine is not running", code="engine_unavailable").response()
        if not engine.is_accepting:
            return APIError(503, "the server is shutting down", code="shutting_down").response()
        return JSONResponse({"status": "ok"})

    @app.get("/live")
    async def live() -> Response:
        """Liveness: 200 while the process can serve or drain; 503 once the engine is dead (restart it)."""
        if not engine.is_running:
            return APIError(503, "the engine is not running", code="engine_unavailable").response()
        return JSONResponse({"status": "draining" if not engine.is_accepting else "ok"})

    @app.get("/get_load")
    async def get_load() -> Response:
        """What vllm-router's power_of_two policy polls: requests this replica's scheduler holds (running and
        waiting; every API process of the replica sees the same figures)."""
        stats = engine.stats()
        return JSONResponse({"load": stats.num_running + stats.num_waiting, "num_requests_running": stats.num_running,
                             "num_requests_waiting": stats.num_waiting})  # fmt: skip

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def models() -> ModelList:
        return ModelList(data=[state.model_card(name) for name in model_names])

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_api_key)])
    async def model(model_id: str) -> ModelCard:
        state.check_model(model_id)
        return state.model_card(model_id)

    app.include_router(openai_routes.router, dependencies=[Depends(require_api_key)])
    app.include_router(completions_routes.router, dependencies=[Depends(require_api_key)])
    app.include_router(tokenize_routes.router, dependencies=[Depends(require_api_key)])
    app.include_router(files.router, dependencies=[Depends(require_api_key)])
    app.include_router(chat_ws.router)  # checks the key itself (header or ?api_key=)
    app.include_router(page.router)  # the web chat page at / (public; it calls the API with the user's key)
    return app
