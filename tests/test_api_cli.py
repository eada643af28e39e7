"""`mmserve serve` as a user runs it: prints the URL, serves, needs the API key from the environment,
and shuts down cleanly (engine drained) on SIGINT."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_prints_url_serves_and_stops_on_sigint(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    port = free_port()
    env = {**os.environ, "MMSERVE_API_KEY": "sk-cli", "MMSERVE_DATA_DIR": str(tmp_path / "data")}
    cmd = [sys.executable, "-m", "mmserve", "serve", "--model", str(tiny_model_dir("qwen2_vl")), "--port", str(port),
           "--num-kv-blocks", "64", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        assert httpx.get(url + "/v1/models").status_code == 401
        headers = {"Authorization": "Bearer sk-cli"}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
        response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] <= 3
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert f"at {url}" in output and f"{url}/v1" in output and str(tmp_path / "data") in output
