"""Engine faults stay contained (real engine, tiny model, real uvicorn socket): a request whose step
fails fails alone and the others' tokens equal a fault-free run; a failed batched step fails only its
requests; a killed engine loop turns /health to 503, ends every open stream with an error within ~2 s
and stops the server with exit status 1; SIGTERM drains (503 for new requests, running ones finish)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from websockets.sync.client import connect

from mmserve import SamplingParams
from mmserve.api import ServerSettings, create_app
from mmserve.api.server import ServerThread
from mmserve.config import EngineArgs
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.faults import RequestFailedError
from tests.test_engine_process import wait_healthy

ASSETS = Path(__file__).resolve().parent.parent / "assets"
HELLO = [{"role": "user", "content": "Describe a red circle on a white background."}]
PROMPTS = ["Describe a red circle.", "What is the capital of France?", "Count to ten.", "Say hi."]


def make_engine(model_dir: Path) -> AsyncEngine:
    return AsyncEngine(
        EngineArgs(str(model_dir), max_num_batched_tokens=128, max_model_len=2048, num_kv_blocks=256)
    )


class Faults:
    """The core's fault injector, armed through utility calls (the core runs in its own process)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def fail_requests(self, patterns: list[str]) -> None:
        self.engine.call_utility("inject_faults", "fail_requests", patterns)

    def fail_next_step(self) -> None:
        self.engine.call_utility("inject_faults", "fail_next_step")

    def kill_loop(self) -> None:
        self.engine.call_utility("inject_faults", "kill_loop")

    def clear(self) -> None:
        self.engine.call_utility("inject_faults", "clear")


def assert_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Zero requests in flight, every KV block free, no encoder-cache entry referenced."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        idle = (
            engine.num_in_flight == 0
            and stats.num_running == 0
            and stats.num_waiting == 0
            and stats.num_free_blocks == stats.num_total_blocks
            and stats.num_referenced_encoder_tokens == 0
            and not any(engine.call_utility("leak_report").values())
        )
        if idle:
            return
        assert time.monotonic() < deadline, (engine.num_in_flight, stats)
        time.sleep(0.05)


async def collect(
    engine: AsyncEngine, prompt: Any, request_id: str, max_tokens: int = 12
) -> list[int] | BaseException:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = None
    try:
        async for item in engine.chat([{"role": "user", "content": prompt}], params, request_id):
            out = item
    except RequestFailedError as exc:
        return exc
    assert out is not None and out.finish_reason == "length"
    return list(out.token_ids)


def image_prompt() -> list[dict[str, Any]]:
    return [{"type": "image", "image": str(ASSETS / "sample.jpg")}, {"type": "text", "text": "What is it?"}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen2_vl")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[AsyncEngine]:
    engine = make_engine(model_dir)
    yield engine
    asyncio.run(engine.shutdown(1.0))


def test_one_request_fault_leaves_the_others_identical(engine: AsyncEngine) -> None:
    prompts: list[Any] = [*PROMPTS, image_prompt()]

    async def batch(tag: str, victim: bool) -> list[list[int] | BaseException]:
        jobs = [collect(engine, p, f"{tag}-{i}") for i, p in enumerate(prompts)]
        if victim:  # same prompt as one of the others, so it also shares prefix blocks with it
            jobs.insert(2, collect(engine, PROMPTS[0], f"{tag}-victim"))
        return await asyncio.gather(*jobs)

    reference = asyncio.run(batch("ref", victim=False))
    Faults(engine).fail_requests(["*-victim"])
    try:
        faulty = asyncio.run(batch("run", victim=True))
    finally:
        Faults(engine).clear()
    assert isinstance(faulty[2], RequestFailedError)
    assert "inside the engine" in str(faulty[2])
    assert faulty[:2] + faulty[3:] == reference  # every other request: the same tokens
    assert_idle(engine)
    assert asyncio.run(batch("after", victim=False)) == reference  # and the engine goes on serving


def test_failed_batched_step_fails_its_requests_and_the_engine_goes_on(engine: AsyncEngine) -> None:
    reference = asyncio.run(collect(engine, PROMPTS[1], "ref-step"))

    async def run() -> list[list[int] | BaseException]:
        jobs = [
            asyncio.ensure_future(collect(engine, p, f"step-{i}", max_tokens=200))
            for i, p in enumerate(PROMPTS)
        ]
        while engine.stats().num_running < len(PROMPTS):
            await asyncio.sleep(0.01)
        Faults(engine).fail_next_step()
        return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    assert all(isinstance(r, RequestFailedError) for r in results)
    assert engine.num_failed_requests >= len(PROMPTS)
    assert_idle(engine)
    assert asyncio.run(collect(engine, PROMPTS[1], "after-step")) == reference


def test_faults_through_the_api_are_500_and_error_events(engine: AsyncEngine, tmp_path: Path) -> None:
    settings = ServerSettings(data_dir=tmp_path, served_model_name="tiny")
    app = create_app(engine, settings)
    live = ServerThread(lambda: app)
    faults = Faults(engine)
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            reference = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"][
                "content"
            ]
            faults.fail_requests(["chatcmpl-*"])
            with connect(live.ws_url) as ws:
                json.loads(ws.recv(timeout=30))  # session.created
                # A WebSocket response runs beside the failing HTTP request, and is unaffected.
                ws.send(json.dumps({"type": "response.create", "response": {"id": "ok", **body}}))
                failed = http.post("/v1/chat/completions", json=body)
                assert failed.status_code == 500
                assert failed.json()["error"]["code"] == "request_failed"
                assert "Injected" not in failed.text and "injected" not in failed.text
                faults.clear()
                faults.fail_requests(["*-bad"])
                ws.send(json.dumps({"type": "response.create", "response": {"id": "bad", **body}}))
                done: dict[str, dict[str, Any]] = {}
                text = ""
                errors = []
                while len(done) < 2:
                    event = json.loads(ws.recv(timeout=30))
                    if event["type"] == "response.done":
                        done[event["response"]["id"]] = event["response"]
                    elif event["type"] == "error":
                        errors.append(event)
                    elif event["type"] == "response.output_text.delta" and event["response_id"] == "ok":
                        text += event["delta"]
                assert done["ok"]["status"] == "incomplete" and text == reference
                assert done["bad"]["status"] == "failed"
                assert [e["response_id"] for e in errors] == ["bad"]
                assert errors[0]["error"]["code"] == "request_failed"
            # SSE: a fault after the stream has started is an in-band error event.
            faults.clear()
            with http.stream(
                "POST", "/v1/chat/completions", json={**body, "max_tokens": 300, "stream": True}
            ) as r:
                events = []
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]")
                    if len(events) == 3:
                        faults.fail_requests(["chatcmpl-*"])
            assert events[-1]["error"]["code"] == "request_failed"
            assert "[DONE]" not in events
            faults.clear()
            assert (
                http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
                == reference
            )
        assert_idle(engine)
        assert app.state.mm.metrics._last_token_time == {}  # no per-request state outlives a failure
    finally:
        faults.clear()
        live.stop()


def test_killed_engine_loop_ends_every_stream_health_503_and_exit_1(model_dir: Path, tmp_path: Path) -> None:
    engine = make_engine(model_dir)
    app = create_app(engine, ServerSettings(data_dir=tmp_path, served_model_name="tiny"))
    live = ServerThread(lambda: app)
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    ended: dict[str, float] = {}

    def sse(name: str) -> None:
        with (
            httpx.Client(base_url=live.url, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if event.get("error"):
                        assert event["error"]["code"] == "engine_unavailable"
                        ended[name] = time.monotonic()

    def ws_client(name: str) -> None:
        with connect(live.ws_url) as ws:
            json.loads(ws.recv(timeout=30))
            ws.send(json.dumps({"type": "response.create", "response": body}))
            while True:
                event = json.loads(ws.recv(timeout=30))
                if event["type"] == "error":
                    assert event["error"]["code"] == "engine_unavailable"
                    ended[name] = time.monotonic()
                elif event["type"] == "response.done":
                    assert event["response"]["status"] == "failed"
                    return

    threads = [
        threading.Thread(target=f, args=(f"{f.__name__}{i}",)) for f in (sse, ws_client) for i in range(2)
    ]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while engine.stats().num_running < 4:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        Faults(engine).kill_loop()
        killed = time.monotonic()
        for t in threads:
            t.join(timeout=10)
        assert sorted(ended) == ["sse0", "sse1", "ws_client0", "ws_client1"]
        assert max(ended.values()) - killed < 2.0  # promptly: no stream hangs
        assert engine.dead.is_set() and not engine.is_running
        # The server stops shortly after the death; the same app answers /health in-process.
        health = TestClient(app).get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
        live.thread.join(timeout=10)
        assert not live.thread.is_alive()
        assert live.server.exit_code == 1  # `mmserve serve` returns it: the process exits non-zero
    finally:
        live.stop()


def test_sigterm_drains_running_requests_then_stops(model_dir: Path, tmp_path: Path) -> None:
    engine = make_engine(model_dir)
    settings = ServerSettings(data_dir=tmp_path, served_model_name="tiny", shutdown_timeout_s=60)
    live = ServerThread(lambda: create_app(engine, settings, own_engine=True))
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 80, "temperature": 0, "ignore_eos": True}
    try:
        with (
            httpx.Client(base_url=live.url, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r,
        ):
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            live.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
            with httpx.Client(base_url=live.url, timeout=10) as other:
                assert other.get("/health").status_code == 503
                refused = other.post("/v1/chat/completions", json=body)
                assert refused.status_code == 503 and "Retry-After" in refused.headers
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the running request finished in full
        finals = [json.loads(line[6:]) for line in rest[:-1]]
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
        live.thread.join(timeout=20)
        assert not live.thread.is_alive() and live.server.exit_code == 0
    finally:
        live.stop()


def test_mmserve_serve_process_drains_on_sigterm_and_exits_0(model_dir: Path, tmp_path: Path) -> None:
    """The real `mmserve serve` process: SIGTERM lets the running stream finish, then exit status 0
    (uvicorn would otherwise re-raise the signal and die of it)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MMSERVE_API_KEY": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmserve", "serve", "--model", str(model_dir), "--port", str(port),
         "--data-dir", str(tmp_path), "--num-kv-blocks", "256", "--max-model-len", "2048",
         "--decode-workers", "1", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, signalled as a whole below (as systemd does)
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 90)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": HELLO, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        with (
            httpx.Client(base_url=url, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r,
        ):
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            os.killpg(proc.pid, signal.SIGTERM)  # the whole group: the engine core is not in it
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
