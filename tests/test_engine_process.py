"""The engine core in its own process: every message type survives the wire (tensors out of band, the
mirrored media cache), and the lifecycle holds with real processes — SIGKILL of the core ends every
stream with an error within 2 s and turns /health to 503; SIGKILL of the API process takes the core
and the decode workers with it; a drain that times out sends each stream its final event; a busy port
or a missing model is one line, before anything loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from fastapi.testclient import TestClient
from websockets.sync.client import connect

from mmserve.api import ServerSettings, create_app
from mmserve.api.server import ServerThread
from mmserve.config import EngineArgs, SchedulerConfig
from mmserve.encoders.vision import EncoderInput
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.messages import EngineCoreOutputs, EngineInfo, StepRecord
from mmserve.engine.serial import Decoder, Encoder
from mmserve.engine.wire import (
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreInput,
    CoreOutput,
    Hello,
    MediaMirror,
    Ready,
    RequestRejected,
    Shutdown,
    StartFailed,
    StepOutputs,
    UtilityCall,
    UtilityResult,
    request_from_wire,
    request_to_wire,
)
from mmserve.request import SLO, MultiModalInput, PlaceholderRange, Request, SamplingParams
from mmserve.scheduler.output import EngineCoreOutput
from mmserve.scheduler.scheduler import SchedulerStats

HELLO_MSG = [{"role": "user", "content": "Describe a red circle on a white background."}]


def roundtrip(message: Any, type_: Any) -> tuple[Any, list]:
    frames = Encoder().encode(message)
    # As ZeroMQ delivers them: separate buffers, the body first.
    return Decoder(type_).decode([bytes(f) for f in frames]), frames


def media_request(request_id: str, mm_hash: str, pixels: torch.Tensor) -> Request:
    data = EncoderInput(pixels, (1, 2, 2))
    mm = MultiModalInput(mm_hash, PlaceholderRange(3, 4), "image", 1, data)
    params = SamplingParams(max_tokens=5, temperature=0.5, stop=["x"], slo=SLO(ttft_ms=300.0), service_class="batch")
    request = Request(request_id, [1, 2, 3, 9, 9, 9, 9, 4], params, eos_token_ids=(0,), mm_inputs=[mm])
    request.mrope_positions = torch.arange(24).reshape(3, 8)
    request.mrope_delta = -2
    return request


def test_every_input_message_round_trips_with_tensors_out_of_band() -> None:
    pixels = torch.randn(4, 12)
    request = media_request("r1", "h1", pixels)
    wire, _ = request_to_wire(request, MediaMirror())
    messages = [
        Hello(0, "ipc:///tmp/x", 123),
        AddRequest(0, wire),
        AbortRequests(["a", "b"], stopped=True),
        UtilityCall(0, 7, "inject_faults", ("fail_requests", ["*-bad"])),
        Shutdown(),
    ]
    for message in messages:
        decoded, frames = roundtrip(message, CoreInput)
        assert type(decoded) is type(message)
        if isinstance(message, AddRequest):
            assert len(frames) == 3  # body + pixels + M-RoPE positions: no tensor inside the body
            assert pixels.numpy().tobytes() not in bytes(frames[0])
            back = request_from_wire(decoded.request, MediaMirror())
            assert back.sampling_params == request.sampling_params
            assert (back.request_id, back.prompt_token_ids, back.eos_token_ids) == ("r1", request.prompt_token_ids, (0,))
            assert back.arrival_time == request.arrival_time and back.mrope_delta == -2
            assert torch.equal(back.mrope_positions, request.mrope_positions)
            (mm,) = back.mm_inputs
            assert (mm.mm_hash, mm.placeholder, mm.modality, mm.num_groups) == ("h1", PlaceholderRange(3, 4), "image", 1)
            assert torch.equal(mm.data.pixel_values, pixels) and mm.data.grid_thw == (1, 2, 2)
        else:
            assert decoded == message


def test_every_output_message_round_trips() -> None:
    stats = SchedulerStats(10, 7, 3, 1, 2, 0, 16, 8, 4, 4, num_referenced_encoder_tokens=4)
    record = StepRecord(0.01, 0.002, 3, 5, 4, 4, 40, 0.006, 0.001)
    outputs = EngineCoreOutputs(
        (
            EngineCoreOutput("a", (5,), ({5: -0.1, 7: -2.5},), None, 3, 12.5, service_class=1),
            EngineCoreOutput("b", (), None, "error", error="InjectedFault: boom"),
        ),
        stats,
        record,
    )
    info = EngineInfo("/m", 2048, SchedulerConfig(max_model_len=2048, interactive_slo=SLO(500.0, 50.0)),
                      "cpu", "float32", "cpu", 16, 128, 1 << 20)  # fmt: skip
    for message in [
        Ready(info),
        StartFailed("no"),
        StepOutputs(outputs),
        StepOutputs(EngineCoreOutputs((), stats)),
        RequestRejected("r", "PromptTooLongError", "too long", "prompt"),
        RequestRejected("s", "SloInfeasibleError", "later", None, 7.5),  # Retry-After crosses too
        UtilityResult(3, {"requests": 0}),
        UtilityResult(4, error="ValueError: x"),
        CoreDead("EngineFatalError: injected"),
    ]:
        decoded, _ = roundtrip(message, CoreOutput)
        assert decoded == message
    decoded, _ = roundtrip(StepOutputs(outputs), CoreOutput)
    assert decoded.outputs.outputs[0].new_logprobs == ({5: -0.1, 7: -2.5},)  # int keys stay ints


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_tensors_of_every_dtype_and_shape_cross_unchanged(dtype: torch.dtype) -> None:
    for shape in [(0,), (3,), (2, 3, 4), (1, 0, 5)]:
        t = (torch.randn(shape) * 10).to(dtype)
        decoded, _ = roundtrip({"t": t, "view": t[..., :1] if t.dim() > 1 else t}, Any)
        assert decoded["t"].dtype == dtype and torch.equal(decoded["t"], t)
        assert torch.equal(decoded["view"], t[..., :1] if t.dim() > 1 else t)  # non-contiguous: copied first


def test_repeated_media_cross_as_their_hash_and_the_mirrors_evict_in_lockstep() -> None:
    pixels = {h: torch.full((4, 12), float(i)) for i, h in enumerate("abc")}
    size = pixels["a"].numel() * 4
    sent, held = MediaMirror(capacity=2 * size), MediaMirror(capacity=2 * size)
    for i, h in enumerate(["a", "b", "a", "c", "b", "a"]):
        wire, commit = request_to_wire(media_request(f"r{i}", h, pixels[h]), sent)
        decoded, frames = roundtrip(AddRequest(0, wire), CoreInput)
        commit()  # once sent
        request = request_from_wire(decoded.request, held)
        assert torch.equal(request.mm_inputs[0].data.pixel_values, pixels[h])
        # r2: "a" again (held); r3 "c" evicts "b"; r4 "b" is sent again and evicts "a"; r5 "a" again.
        repeated = i == 2
        assert (wire.mm_inputs[0].pixel_values is None) == repeated, i
        assert len(frames) == (2 if repeated else 3)


# -- real processes ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen2_vl")


def make_engine(model_dir: Path) -> AsyncEngine:
    return AsyncEngine(EngineArgs(str(model_dir), max_num_batched_tokens=128, max_model_len=2048, num_kv_blocks=256))


def stream_clients(live: ServerThread, body: dict, ended: dict[str, Any], n: int = 2) -> list[threading.Thread]:
    """n SSE and n WebSocket clients on long responses; each records how its stream ended, and when."""

    def sse(name: str) -> None:
        with (
            httpx.Client(base_url=live.url, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r,
        ):
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        last = json.loads(events[-2] if events[-1] == "[DONE]" else events[-1])
        ended[name] = (time.monotonic(), events[-1] == "[DONE]", last)

    def ws_client(name: str) -> None:
        with connect(live.ws_url) as ws:
            json.loads(ws.recv(timeout=30))
            ws.send(json.dumps({"type": "response.create", "response": body}))
            events = []
            while True:
                events.append(json.loads(ws.recv(timeout=30)))
                if events[-1]["type"] == "response.done":
                    ended[name] = (time.monotonic(), [e for e in events if e["type"] == "error"], events[-1])
                    return

    threads = [threading.Thread(target=f, args=(f"{f.__name__}{i}",)) for f in (sse, ws_client) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def wait_running(engine: AsyncEngine, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.stats().num_running < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_sigkill_of_the_engine_process_ends_every_stream_within_2s(model_dir: Path, tmp_path: Path) -> None:
    engine = make_engine(model_dir)
    pid = engine.engine_process_pid
    assert pid is not None and pid != os.getpid()
    app = create_app(engine, ServerSettings(data_dir=tmp_path, served_model_name="tiny"))
    live = ServerThread(lambda: app)
    body = {"model": "tiny", "messages": HELLO_MSG, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    ended: dict[str, Any] = {}
    try:
        threads = stream_clients(live, body, ended)
        wait_running(engine, 4)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(timeout=10)
        assert sorted(ended) == ["sse0", "sse1", "ws_client0", "ws_client1"]
        assert max(t for t, _, _ in ended.values()) - killed < 2.0
        for name, (_, extra, last) in ended.items():
            if name.startswith("sse"):
                assert not extra and last["error"]["code"] == "engine_unavailable"  # no [DONE]: it failed
            else:
                assert [e["error"]["code"] for e in extra] == ["engine_unavailable"]
                assert last["response"]["status"] == "failed"
        assert engine.dead.is_set() and not engine.is_running
        client = TestClient(app)
        assert client.get("/health").status_code == 503 and client.get("/live").status_code == 503
        live.thread.join(timeout=10)
        assert live.server.exit_code == 1
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        live.stop()
        engine.close()


def test_an_engine_never_closed_leaves_no_core_and_no_socket_directory(model_dir: Path) -> None:
    """A script that starts an engine and just ends: multiprocessing terminates the core, and the socket
    directory goes with it (the core's own cleanup does not run on that SIGTERM; the front end's does, at exit)."""
    code = (
        "import sys, os, psutil; from mmserve.config import EngineArgs; from mmserve.engine.async_engine import AsyncEngine\n"
        "engine = AsyncEngine(EngineArgs(sys.argv[1], max_model_len=2048, num_kv_blocks=64))\n"
        "core = psutil.Process(engine.engine_process_pid)\n"
        "print(core.pid, *{os.path.dirname(c.laddr) for c in core.net_connections(kind='unix') if c.laddr})\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    pid, *directories = done.stdout.split()
    assert directories and all(os.path.basename(d).startswith("mmserve-core-") for d in directories)
    assert not any(os.path.exists(d) for d in directories)
    assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE


def test_a_drain_that_times_out_sends_every_stream_its_final_event(model_dir: Path, tmp_path: Path) -> None:
    engine = make_engine(model_dir)
    settings = ServerSettings(data_dir=tmp_path, served_model_name="tiny", shutdown_timeout_s=1.0)
    live = ServerThread(lambda: create_app(engine, settings, own_engine=True))
    body = {"model": "tiny", "messages": HELLO_MSG, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    ended: dict[str, Any] = {}
    try:
        threads = stream_clients(live, body, ended)
        wait_running(engine, 4)
        live.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        draining = time.monotonic()
        client = TestClient(create_app(engine, settings))
        assert client.get("/health").status_code == 503  # readiness: draining
        assert client.get("/live").json() == {"status": "draining"}  # liveness: still serving
        for t in threads:
            t.join(timeout=15)
        assert sorted(ended) == ["sse0", "sse1", "ws_client0", "ws_client1"]
        for name, (when, extra, last) in ended.items():
            assert when - draining < settings.shutdown_timeout_s + 1.5
            if name.startswith("sse"):
                assert extra  # [DONE] came after the last chunk
                assert last["choices"][0]["finish_reason"] == "abort"
            else:
                assert not extra
                assert last["response"]["status"] == "incomplete"
                assert last["response"]["incomplete_details"] == {"reason": "server_shutdown"}
        live.thread.join(timeout=10)
        assert not live.thread.is_alive() and live.server.exit_code == 0
        assert time.monotonic() - draining < settings.shutdown_timeout_s + 5
    finally:
        live.stop()
        engine.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, port: int, tmp_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mmserve", "serve", "--model", model, "--port", str(port), "--data-dir",
         str(tmp_path), "--num-kv-blocks", "256", "--max-model-len", "2048", "--decode-workers", "1",
         "--log-level", "warning", *extra],
        env={**os.environ, "MMSERVE_API_KEY": ""}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def socket_dirs(*procs: psutil.Process) -> set[str]:
    """The directories of the ZeroMQ ipc sockets that these processes have bound (mmserve's, under the
    temporary directory)."""
    paths = {c.laddr for p in procs for c in p.net_connections(kind="unix") if isinstance(c.laddr, str)}
    return {os.path.dirname(path) for path in paths if os.path.basename(os.path.dirname(path)).startswith("mmserve-")}


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Until `url`/health answers 200; fails if the server exits first (with its output) or is late."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not become healthy"
        time.sleep(0.2)


def test_a_busy_port_and_a_missing_model_are_one_line_before_anything_loads(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = serve(str(tmp_path / "no-such-model"), busy.getsockname()[1], tmp_path)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "cannot listen" in out and "Traceback" not in out, out
    proc = serve(str(tmp_path / "no-such-model"), free_port(), tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "is not a checkpoint directory" in out and "Traceback" not in out, out


LOADING_SEEN: list[tuple[int, str, int, str]] = []  # (pid, path, status, body) answered while loading


@pytest.fixture
def served(model_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    proc = serve(str(model_dir), port, tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                live = httpx.get(f"{url}/live", timeout=1)
                health = httpx.get(f"{url}/health", timeout=1)
                if health.status_code == 200:
                    break
                LOADING_SEEN.append((proc.pid, "/live", live.status_code, live.text))
                LOADING_SEEN.append((proc.pid, "/health", health.status_code, health.text))
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_sigkill_of_the_api_process_takes_the_core_and_the_decode_workers_with_it(
    served: tuple[subprocess.Popen, str],
) -> None:
    proc, url = served
    children = psutil.Process(proc.pid).children(recursive=True)
    names = " ".join(" ".join(c.cmdline()) for c in children)
    assert "multiprocessing" in names and len(children) >= 2, names  # the engine core and a decode worker
    body = {"messages": HELLO_MSG, "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    started = threading.Event()

    def stream() -> None:
        try:
            with httpx.Client(base_url=url, timeout=30) as http, http.stream(
                "POST", "/v1/chat/completions", json={**body, "model": http.get("/v1/models").json()["data"][0]["id"], "stream": True}
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        started.set()
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert started.wait(30)
    sockets = socket_dirs(psutil.Process(proc.pid), *children)
    assert len(sockets) == 1  # the core's: its input and the API process's output socket
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [c.cmdline() for c in alive]  # no orphaned core or decode worker
    assert not any(os.path.exists(d) for d in sockets)  # the core removed it on its way out: its starter could not


def test_the_banner_states_the_kv_pool_and_the_engine_process(served: tuple[subprocess.Popen, str]) -> None:
    proc, _ = served
    # While the model loaded, the bound port answered: liveness 200 "loading", readiness 503 "loading".
    seen = {(path, status, json.loads(body).get("status") or json.loads(body)["error"]["code"])
            for pid, path, status, body in LOADING_SEEN if pid == proc.pid}  # fmt: skip
    assert seen == {("/live", 200, "loading"), ("/health", 503, "loading")}, seen
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "KV pool 256 blocks x 16 tokens = 4096 tokens" in out and "2.00x concurrency" in out, out
    assert "engine core pid" in out


def test_utility_calls_and_messages_stay_typed(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    try:
        stats = engine.call_utility("stats")
        assert isinstance(stats, SchedulerStats) and stats.num_total_blocks == 256
        assert isinstance(engine.call_utility("info"), EngineInfo)
        assert engine.call_utility("reset_prefix_cache") is True
        with pytest.raises(Exception, match="unknown engine utility"):
            engine.call_utility("step")  # only the listed utilities are callable
        assert not any(engine.call_utility("leak_report").values())
    finally:
        engine.close()


def test_two_api_servers_share_the_port_and_the_core_and_metrics_sum_over_both(
    model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    proc = serve(str(model_dir), port, tmp_path, "--api-server-count", "2")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, 120)
        children = psutil.Process(proc.pid).children()
        spawned = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
        assert len(spawned) == 3  # the engine core and two API servers
        body = {"messages": HELLO_MSG, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

        def one(_: int) -> str:
            with httpx.Client(base_url=url, timeout=60) as http:
                return http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(one, range(16)))
        assert len(set(texts)) == 1  # greedy: the same answer whichever API process served it
        for _ in range(6):  # whichever process answers the scrape, the counters cover both
            text = httpx.get(f"{url}/metrics", timeout=10).text
            tokens = next(line for line in text.splitlines() if line.startswith("mmserve:generation_tokens_total"))
            assert float(tokens.rsplit(" ", 1)[1]) == 16 * 8
        # Kill one API process: the core frees its requests, the other API process goes on serving.
        api = [c for c in spawned if any(k.laddr.port == port for k in c.net_connections(kind="tcp"))]
        assert len(api) == 2  # both API processes listen on the one socket; the core does not
        sockets = socket_dirs(*spawned)
        assert len(sockets) == 1  # the core's: its input and both API processes' output sockets
        api[0].kill()
        api[0].wait(10)
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(one, range(8))) == texts[:8]
        def idle() -> bool:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            values = {
                name: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                for name in ("num_requests_running", "kv_cache_usage_perc")
                if line.startswith(f"mmserve:{name}{{")
            }
            return values == {"num_requests_running": 0.0, "kv_cache_usage_perc": 0.0}

        deadline = time.monotonic() + 10
        while not idle():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 1  # an API server died under it: a supervisor should know
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in spawned)
        assert not any(os.path.exists(d) for d in sockets)  # with the killed API process's socket in it
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
