"""`mmserve serve`: bind the port, start the engine (its core in its own process), print where it
listens and what it holds, run uvicorn until a signal.

SIGTERM / SIGINT drain (`DrainingServer`): new requests get 503 at once, running ones finish for up to
`shutdown_timeout_s`; then every stream still open is ended with a final event (SSE: a last chunk with
`finish_reason` "abort" and [DONE]; WebSocket: `response.done` with status "incomplete", reason
"server_shutdown"), and the server stops with exit status 0. If the engine dies the server stops at once
with exit status 1, so a supervisor restarts it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from mmserve.api.app import create_app
from mmserve.api.settings import ServerSettings
from mmserve.config import EngineArgs
from mmserve.encoders.media import MediaLimits
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.core_client import CoreHandle, start_engine_core
from mmserve.engine.loader import resolve_checkpoint
from mmserve.errors import MMServeError

logger = logging.getLogger(__name__)


_FINAL_EVENTS_S = 0.5  # after streams are ended (engine death, drain timeout): time to send their events


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain on SIGTERM/SIGINT and an exit when the engine dies."""

    def __init__(
        self, config: uvicorn.Config, engine: AsyncEngine, drain_timeout_s: float, ignore_sigint: bool = False
    ) -> None:
        """`ignore_sigint`: an API server under the launcher, which forwards Ctrl-C as one SIGTERM."""
        super().__init__(config)
        self.engine, self.drain_timeout_s, self.ignore_sigint = engine, drain_timeout_s, ignore_sigint
        self.exit_code = 0
        self._drain_deadline: float | None = None
        self._exit_at: float | None = None  # streams have been sent their final events; stop then

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT and self.ignore_sigint:
            return
        if self._drain_deadline is not None and sig == signal.SIGTERM:
            return  # the same shutdown asked again (e.g. a process group's SIGTERM): keep draining
        if self._drain_deadline is not None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)  # a second signal: stop now (uvicorn's own shutdown)
            return
        # Not appended to _captured_signals: uvicorn would re-raise it after the drain, and the
        # process would die of the signal instead of exiting 0.
        logger.info("draining: refusing new requests; %d in flight", self.engine.num_in_flight)
        self.engine.drain()
        self._drain_deadline = time.monotonic() + self.drain_timeout_s

    async def on_tick(self, counter: int) -> bool:
        now = time.monotonic()
        if self.engine.dead.is_set() and self.exit_code == 0:
            logger.critical("the engine died: stopping the server (exit status 1)")
            self.exit_code = 1
            # Not at once: the streams were failed on the output thread, and each handler still has to
            # send its error event; closing now can beat it (a WebSocket then sees only code 1012).
            self._exit_at = now + _FINAL_EVENTS_S
        if self._drain_deadline is not None and self._exit_at is None:
            if self.engine.num_in_flight == 0:
                self._exit_at = now
            elif now >= self._drain_deadline:
                n = self.engine.abort_all("shutdown")  # each stream gets its final event
                logger.warning("drain timeout: ended %d requests still in flight", n)
                self._exit_at = now + _FINAL_EVENTS_S
        if self._exit_at is not None and now >= self._exit_at:
            self.should_exit = True
        return await super().on_tick(counter)


def uvicorn_config(app: Any, settings: ServerSettings, **kwargs: Any) -> uvicorn.Config:
    """The connection-level limits of `settings` (header size, keep-alive, WebSocket ping) for uvicorn."""
    return uvicorn.Config(
        app,
        # uvloop where it is installed (a dependency off Windows), else asyncio's: with uvloop the loop's own
        # work per streamed token (its wake-up, the hand-over from the output thread, the socket write) is C.
        loop="auto",
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


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads, so a busy port is reported at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise MMServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class LoadingResponder:
    """Answers on the bound socket while the model loads, so probes get an answer instead of a hang:
    `/live` 200 {"status": "loading"}, everything else 503 `loading` with Retry-After. `stop()` hands the
    socket over to uvicorn; connections that arrive after it wait in the backlog for uvicorn."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.listen(128)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmserve-loading", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        import select

        while not self._stop.is_set():
            readable, _, _ = select.select([self.sock], [], [], 0.05)
            if not readable or self._stop.is_set():
                continue
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, OSError):
                continue
            with conn:
                conn.settimeout(2.0)
                try:
                    line = conn.recv(4096).split(b"\r\n", 1)[0].split()
                except OSError:
                    continue
                path = line[1].decode("latin-1") if len(line) > 1 else ""
                if path.split("?")[0] == "/live":
                    status, body = "200 OK", b'{"status": "loading"}'
                else:
                    status = "503 Service Unavailable"
                    body = (b'{"error": {"message": "the model is loading", "type": "service_unavailable", '
                            b'"param": null, "code": "loading"}}')  # fmt: skip
                head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
                        "\r\nretry-after: 1\r\nconnection: close\r\n\r\n")  # fmt: skip
                with contextlib.suppress(OSError):
                    conn.sendall(head.encode() + body)


@dataclass(frozen=True)
class ServeOptions:
    """What `mmserve serve` passes to each API server process."""

    engine_args: EngineArgs
    settings: ServerSettings
    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting_requests: int = 1024
    log_level: str = "info"
    media_limits: MediaLimits | None = None
    engine_process: bool = True


def run_server(options: ServeOptions, api_server_count: int = 1) -> int:
    """Serves until a signal (then returns 0 after draining) or until the engine dies (returns 1).
    A busy port or a bad model directory is one line on stderr and exit status 2, before any load.

    With `api_server_count` > 1, this process only launches: one engine-core process and that many API
    server processes, which share the listening socket (each accepts on it) and the core."""
    try:
        sock = bind_socket(options.host, options.port)
        args = resolve_checkpoint(options.engine_args)
    except MMServeError as exc:
        print(f"mmserve: {exc}", file=sys.stderr, flush=True)
        if "sock" in locals():
            sock.close()
        return 2
    options = dataclasses.replace(options, engine_args=args)
    loading = LoadingResponder(sock)
    if api_server_count <= 1:
        return _serve_api(options, sock, loading=loading)
    return _launch(options, sock, api_server_count, loading)


def _serve_api(
    options: ServeOptions,
    sock: socket.socket,
    core: CoreHandle | None = None,
    index: int = 0,
    loading: LoadingResponder | None = None,
    ready: Any = None,
) -> int:
    """One API server process: its front end (own core, or front end `index` of a shared `core`) and
    uvicorn. `loading` answers probes until the engine is up; `ready` (an Event) is set then."""
    settings = options.settings
    try:
        engine = AsyncEngine(
            options.engine_args,
            max_waiting_requests=options.max_waiting_requests,
            media_limits=options.media_limits,
            engine_process=options.engine_process,
            core=core,
            client_index=index,
        )
    except MMServeError as exc:
        print(f"mmserve: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if loading is not None:
            loading.stop()
        if ready is not None:
            ready.set()
    app = create_app(engine, settings, own_engine=True)
    if index == 0:
        host = options.host
        shown = f"[{host}]" if ":" in host else host
        base = f"http://{shown}:{options.port}"
        auth = "API key required (Authorization: Bearer ...)" if settings.api_key else "no API key"
        if not options.engine_process:
            where = "engine core in-process"
        else:
            where = f"engine core pid {engine.engine_process_pid}"
        print(
            f"mmserve: serving {engine.model_name} as {app.state.mm.model_name!r} at {base}  ({auth})\n"
            f"  OpenAI base_url: {base}/v1    WebSocket chat: ws://{shown}:{options.port}/v1/chat/ws    "
            f"metrics: {base}/metrics\n  {engine.info.banner()}\n  {where}; uploads stored in {settings.data_dir}",
            flush=True,
        )
    config = uvicorn_config(
        app,
        settings,
        log_level=options.log_level,
        timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 1,
    )
    server = DrainingServer(config, engine, settings.shutdown_timeout_s, ignore_sigint=core is not None)
    server.run(sockets=[sock])
    return server.exit_code


def _api_server_main(options: ServeOptions, sock: socket.socket, core: CoreHandle, index: int, ready: Any) -> None:
    """A spawned API server process (one of `--api-server-count`). Ctrl-C reaches the whole process group:
    the launcher forwards SIGTERM instead, so each API server drains once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(_serve_api(options, sock, core, index, ready=ready))


def _launch(options: ServeOptions, sock: socket.socket, count: int, loading: LoadingResponder) -> int:
    """The `--api-server-count` launcher: a shared engine core, `count` API processes on one socket,
    request metrics summed across them (prometheus-client's multiprocess mode). SIGTERM / SIGINT: each API
    server drains, then the core stops. Exit status: 1 if the core or any API server failed, else 0."""
    metrics_dir = tempfile.mkdtemp(prefix="mmserve-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by each API process at import
    stopping = threading.Event()
    servers: list[Any] = []

    def forward(sig: int, frame: FrameType | None) -> None:
        if stopping.is_set():
            return  # one drain per API server; a second Ctrl-C does not cut it short
        stopping.set()
        for process in servers:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)  # before anything starts: a signal while loading cleans up too
    signal.signal(signal.SIGINT, forward)
    core_process, core = start_engine_core(options.engine_args)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()  # the first API server up takes the socket over from the loading responder
    failed, reported = False, set()
    try:
        servers.extend(
            ctx.Process(target=_api_server_main, args=(options, sock, core, i, ready), name=f"mmserve-api-{i}")
            for i in range(count)
        )
        for process in servers:
            process.start()
        while not ready.wait(0.2) and any(p.is_alive() for p in servers) and not stopping.is_set():
            pass
        loading.stop()
        sock.close()  # the API processes hold it now
        while any(p.is_alive() for p in servers):
            if not core_process.is_alive() and not stopping.is_set():
                logger.critical("the engine core died: stopping the API servers")
                failed = True
                forward(signal.SIGTERM, None)
            for process in servers:
                process.join(0.2)
                if not process.is_alive() and process.exitcode not in (0, None) and process not in reported:
                    # The core aborts a dead front end's requests; the other API servers go on.
                    logger.error("API server %s exited with status %s", process.name, process.exitcode)
                    reported.add(process)
                    failed = True
    finally:
        loading.stop()
        for process in servers:
            process.join(5)
            if process.is_alive():
                process.kill()
        failed |= any(p.exitcode not in (0, None) for p in servers) or not core_process.is_alive()
        # No front end is left: the core has nothing to finish.
        core_process.terminate()
        core_process.join(10)
        if core_process.is_alive():
            core_process.kill()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(core.directory, ignore_errors=True)
    return 1 if failed else 0


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
