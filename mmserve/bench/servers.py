"""The servers a benchmark runs against: `InProcessServer` (the app over a real engine, uvicorn in a thread of
this process), `ServerProcess` (`mmserve serve` as a child, as deployed), or a URL given by the user (nothing to
start). The router bench's replicas are `ServerProcess`es too."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class InProcessServer:
    """`create_app` over a real `AsyncEngine`, served by uvicorn in a daemon thread on a free port."""

    def __init__(self, model: Path, served_model_name: str = "bench", **engine_kwargs: Any) -> None:
        from mmserve.api.app import create_app
        from mmserve.api.server import ServerThread
        from mmserve.api.settings import ServerSettings
        from mmserve.config import EngineArgs
        from mmserve.engine.async_engine import AsyncEngine

        self._tmp = tempfile.TemporaryDirectory(prefix="mmserve-bench-")
        self.engine = AsyncEngine(EngineArgs(str(model), **engine_kwargs), max_waiting_requests=1 << 20)
        settings = ServerSettings(data_dir=Path(self._tmp.name), served_model_name=served_model_name)
        app = create_app(self.engine, settings)
        self.server = ServerThread(lambda: app, ws_max_size=settings.max_ws_message_bytes + 1024)
        self.url = self.server.url

    def close(self) -> None:
        self.server.stop()
        asyncio.run(self.engine.shutdown(1.0))
        self._tmp.cleanup()


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path, what: str) -> None:
    """Until `url`/health answers 200; raises with the tail of `log_path` if `proc` exits or `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up: {log_path.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)


class ServerProcess:
    """`mmserve serve` in a child process on a free port, as it is deployed: its engine loop and event
    loop share no GIL with the benchmark's clients (the in-process server's do). Its log goes to a
    temporary file, whose tail is raised when the server fails to come up (within 300 s)."""

    def __init__(self, model: Path, *, port: int | None = None, served_model_name: str = "bench",
                 extra_args: Sequence[str] = (), wait: bool = True, env: dict[str, str] | None = None,
                 **engine_kwargs: Any) -> None:  # fmt: skip
        """`engine_kwargs`: EngineArgs fields that `mmserve serve` has flags for (None: its default);
        `extra_args`: more flags as given. `port` None: a free one. `wait` False: `wait_until_up` later.
        `env`: variables set for the server beside this process's."""
        self._tmp = tempfile.TemporaryDirectory(prefix="mmserve-bench-")
        self.port = port = port or free_port()
        self.url = f"http://127.0.0.1:{port}"
        # No queue cap below the benchmark's own load, as InProcessServer.
        cmd = [sys.executable, "-m", "mmserve", "serve", "--model", str(model), "--port", str(port),
               "--served-model-name", served_model_name, "--log-level", "warning",
               "--max-waiting-requests", str(1 << 20), *extra_args]  # fmt: skip
        for name, value in engine_kwargs.items():
            if name == "chunk_encoder":
                cmd += [] if value else ["--no-chunk-encoder"]
            elif isinstance(value, bool):  # a switch: present when true
                cmd += [f"--{name.replace('_', '-')}"] if value else []
            elif value is not None:
                cmd += [f"--{name.replace('_', '-')}", str(value)]
        env = {**os.environ, **(env or {}), "MMSERVE_DATA_DIR": str(Path(self._tmp.name) / "data")}
        env.pop("MMSERVE_API_KEY", None)
        self.log_path = Path(self._tmp.name) / "server.log"
        self._log = self.log_path.open("w")
        self.proc: subprocess.Popen | None = None
        try:  # whatever happens before it is up (Ctrl-C included), no child or temp dir is left behind
            self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
            if wait:
                self.wait_until_up()
        except BaseException:
            self.close()
            raise

    def wait_until_up(self) -> None:
        assert self.proc is not None
        wait_until_healthy(self.proc, self.url, 300.0, self.log_path, "the server")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._tmp.cleanup()
