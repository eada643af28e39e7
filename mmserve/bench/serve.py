"""`mmserve bench serve`: online serving benchmark over the WebSocket chat or the OpenAI SSE route,
against a URL or an in-process server, with `vllm bench serve`'s arrivals and metrics. Knows the wire
formats of docs/api.md, never the engine's internals."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import itertools
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mmserve.bench.metrics import (
    RequestTiming,
    compute_metrics,
    first_vs_repeats_ttft,
    throughput_figures,
    video_interference,
)

WORKLOADS = ("random", "random-mm", "prefix", "long-video")
MEDIA_SOURCES = ("data-url", "upload")
TRANSPORTS = ("ws", "http")
# --quick: small enough to finish in well under a minute on the tiny model on 2 CPU cores.
QUICK = {"num_prompts": 8, "input_len": (8, 32), "output_len": (4, 16)}

_WORDS = (
    "the a red blue green circle square image video frame token cache block decode prefill model "
    "server request stream latency batch of in on with and to is what why how describe count"
).split()


VIDEO_OUTPUT_LEN = 8  # long-video: tokens each video request generates (a short answer)


@dataclass(frozen=True)
class BenchRequest:
    messages: list[dict]
    output_len: int
    extra: dict[str, Any] = field(default_factory=dict)  # more body fields (e.g. service_tier, priority)
    # long-video's videos: sent once every other request streams, `video_interval_s` apart (run_requests)
    late: bool = False


def _random_text(rng: random.Random, n: int, tokenizer: Any | None) -> str:
    """About `n` prompt tokens: decoded random ids when a tokenizer is at hand, else random words."""
    if tokenizer is None:
        return " ".join(rng.choice(_WORDS) for _ in range(n))
    ids = [rng.randrange(100, max(101, len(tokenizer) - 300)) for _ in range(n)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def _png_data_url(rng: np.random.Generator, size: int, image_format: str = "png") -> str:
    """A random `size`^2 image as a data URL, PNG (lossless: every pixel as drawn) or JPEG (quality 90)."""
    from PIL import Image

    pixels = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    if image_format == "jpeg":
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _mp4_data_url(rng: np.random.Generator, num_frames: int, size: int) -> str:
    """`num_frames` random `size`^2 frames as an H.264 mp4 at the server's sampling rate (every frame
    is kept) in a data URL."""
    from mmserve.demo.data import encode_mp4
    from mmserve.encoders.media import DEFAULT_LIMITS

    frames = rng.integers(0, 255, (num_frames, size, size, 3), dtype=np.uint8)  # [T, H, W, 3]
    return "data:video/mp4;base64," + base64.b64encode(encode_mp4(frames, DEFAULT_LIMITS.video_fps)).decode()


def build_requests(
    workload: str,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
    tokenizer: Any | None = None,
    num_images: int | None = None,
    image_size: int = 64,
    prefix_len: int = 512,
    num_frames: int = 0,
    video_size: int = 112,
    num_videos: int = 2,
    image_format: str = "png",
) -> list[BenchRequest]:
    """`random`: text prompts of random length; `random-mm`: the same, each with `num_images` (default 1)
    random images of `image_size`^2 pixels sent as PNG data URLs and (num_frames > 0) one video of
    `num_frames` random `video_size`^2 frames sent as an mp4 data URL (distinct per request: no cache
    hits); `prefix`: every prompt starts with the same `num_images` (default 0) images of `image_size`^2
    pixels (the same pixels, so one mm_hash each: encoder- and prefix-cache hits), then the same text of
    about `prefix_len` tokens, then a random text of its own; `long-video`: the `random` text prompts,
    then `num_videos` requests of one video each (`num_frames` random `video_size`^2 frames and a short
    question, VIDEO_OUTPUT_LEN tokens out), marked `late`: they arrive while the texts decode."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")
    num_images = resolve_num_images(workload, num_images)
    if workload == "random-mm" and (num_images < 0 or num_frames < 0 or num_images + num_frames == 0):
        raise ValueError("random-mm needs images (--num-images) or a video (--num-frames), none negative")
    if workload == "prefix" and num_images < 0:
        raise ValueError("prefix: --num-images must not be negative")
    if workload == "long-video" and (num_videos < 1 or num_frames < 1):
        raise ValueError("long-video needs --num-videos and --num-frames >= 1")
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    prefix = _random_text(rng, prefix_len, tokenizer) + "\n" if workload == "prefix" else ""

    def image_parts() -> list[dict]:  # `num_images` fresh random PNGs as content parts
        return [
            {"type": "image_url", "image_url": {"url": _png_data_url(np_rng, image_size, image_format)}}
            for _ in range(num_images)
        ]

    # prefix: one set of images, in front of every prompt (the same data URL, hence the same pixels).
    shared_images = image_parts() if workload == "prefix" else []
    out = []
    for _ in range(num_prompts):
        text = prefix + _random_text(rng, rng.randint(*input_len), tokenizer)
        content: str | list[dict] = text
        if shared_images:
            content = [*shared_images, {"type": "text", "text": text}]
        if workload == "random-mm":
            content = image_parts()
            if num_frames:
                url = _mp4_data_url(np_rng, num_frames, video_size)
                content.append({"type": "video_url", "video_url": {"url": url}})
            content.append({"type": "text", "text": text})
        out.append(BenchRequest([{"role": "user", "content": content}], rng.randint(*output_len)))
    if workload == "long-video":
        for j in range(num_videos):
            content = [
                {"type": "video_url", "video_url": {"url": _mp4_data_url(np_rng, num_frames, video_size)}},
                {"type": "text", "text": f"What happens in clip {j}?"},
            ]
            out.append(BenchRequest([{"role": "user", "content": content}], VIDEO_OUTPUT_LEN, late=True))
    return out


def resolve_num_images(workload: str, num_images: int | None) -> int:
    """Images per prompt: `num_images`, or the workload's default (random-mm 1, prefix 0, random none)."""
    if workload not in ("random-mm", "prefix"):
        return 0
    if num_images is not None:
        return num_images
    return 1 if workload == "random-mm" else 0


def _body(req: BenchRequest) -> dict:
    return {"messages": req.messages, "max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
            **req.extra}  # fmt: skip


# -- transports ------------------------------------------------------------------------------------


async def send_http(
    client: Any, base_url: str, req: BenchRequest, headers: dict, first_token: asyncio.Event | None = None
) -> RequestTiming:
    """One streamed `POST /v1/chat/completions`; each non-empty content delta's arrival is recorded, and
    `first_token` (if given) is set at the first."""
    body = {"model": "bench", **_body(req), "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunks: list[float] = []
    usage: dict = {}
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(event["error"].get("message", "stream error"))
                if any(c.get("delta", {}).get("content") for c in event.get("choices", ())):
                    chunks.append(now)
                    if first_token is not None:
                        first_token.set()
                if event.get("usage"):
                    usage = event["usage"]
        end = time.perf_counter()
    except Exception as exc:  # a failed request is a figure, not a crash
        return RequestTiming(
            start, tuple(chunks), time.perf_counter(), 0, 0, False, f"{type(exc).__name__}: {exc}"
        )
    return RequestTiming(
        start, tuple(chunks), end, usage.get("prompt_tokens", 0), usage.get("completion_tokens", len(chunks))
    )


class WSPool:
    """A few WebSocket chat sockets shared by all requests; a reader per socket routes each event to
    its response's queue with its arrival time."""

    def __init__(self, url: str, size: int, api_key: str | None) -> None:
        ws_url = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/v1/chat/ws"
        self.url = ws_url
        self.size = size
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.sockets: list[Any] = []
        self.readers: list[asyncio.Task] = []
        self.queues: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._next = itertools.cycle(range(size))

    async def __aenter__(self) -> WSPool:
        from websockets.asyncio.client import connect

        for _ in range(self.size):
            ws = await connect(self.url, additional_headers=self.headers, max_size=None, open_timeout=30)
            self.sockets.append(ws)
            self.readers.append(asyncio.create_task(self._read(ws)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for ws in self.sockets:
            await ws.close()
        for task in self.readers:
            task.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)

    async def _read(self, ws: Any) -> None:
        try:
            async for message in ws:
                now = time.perf_counter()
                event = json.loads(message)
                rid = event.get("response_id") or (event.get("response") or {}).get("id")
                queue = self.queues.get(rid) if rid else None
                if queue is not None:
                    queue.put_nowait((now, event))
        except Exception as exc:  # socket gone: fail whatever is still waiting on it
            for queue in self.queues.values():
                queue.put_nowait((time.perf_counter(), {"type": "error", "error": {"message": str(exc)}}))

    async def send(self, req: BenchRequest, first_token: asyncio.Event | None = None) -> RequestTiming:
        """One `response.create`; each non-empty text delta's arrival is recorded, and `first_token` (if
        given) is set at the first."""
        rid = f"b{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue
        ws = self.sockets[next(self._next)]
        start = time.perf_counter()
        chunks: list[float] = []
        try:
            await ws.send(json.dumps({"type": "response.create", "response": {"id": rid, **_body(req)}}))
            while True:
                now, event = await queue.get()
                kind = event.get("type")
                if kind == "response.output_text.delta" and event.get("delta"):
                    chunks.append(now)
                    if first_token is not None:
                        first_token.set()
                elif kind == "error":
                    raise RuntimeError(event["error"].get("message", "error event"))
                elif kind == "response.done":
                    response = event["response"]
                    if response.get("status") == "failed":
                        raise RuntimeError(f"response failed: {response.get('error')}")
                    usage = response.get("usage") or {}
                    return RequestTiming(
                        start,
                        tuple(chunks),
                        now,
                        usage.get("prompt_tokens", 0),
                        usage.get("completion_tokens", len(chunks)),
                    )
        except Exception as exc:
            return RequestTiming(
                start, tuple(chunks), time.perf_counter(), 0, 0, False, f"{type(exc).__name__}: {exc}"
            )
        finally:
            self.queues.pop(rid, None)


async def upload_media(
    client: Any, base_url: str, requests: list[BenchRequest], headers: dict
) -> list[BenchRequest]:
    """`--media-source upload`: upload each distinct data-URL image or video once (before timing) and
    refer to it by id; a URL repeated across requests (the prefix workload's images) shares one file."""
    file_ids: dict[str, str] = {}  # data URL -> uploaded file id
    out = []
    for req in requests:
        messages = []
        for message in req.messages:
            content = message["content"]
            if isinstance(content, list):
                parts = []
                for part in content:
                    kind = part["type"]  # "text" | "image_url" | "video_url"
                    url = part.get(kind, {}).get("url", "") if kind != "text" else ""
                    if url.startswith("data:") and url not in file_ids:
                        data = base64.b64decode(url.split(",", 1)[1])
                        name, mime = (
                            ("bench.png", "image/png") if kind == "image_url" else ("bench.mp4", "video/mp4")
                        )
                        r = await client.post(
                            f"{base_url}/v1/files",
                            files={"file": (name, data, mime)},
                            data={"purpose": "vision"},
                            headers=headers,
                        )
                        if r.status_code != 200:
                            raise RuntimeError(f"upload failed: HTTP {r.status_code}: {r.text[:200]}")
                        file_ids[url] = r.json()["id"]
                    if url in file_ids:
                        part = {"type": kind, kind: {"url": file_ids[url]}}
                    parts.append(part)
                content = parts
            messages.append({**message, "content": content})
        out.append(BenchRequest(messages, req.output_len, req.extra))
    return out


# -- the run ---------------------------------------------------------------------------------------


async def arrivals(n: int, request_rate: float, burstiness: float, seed: int) -> AsyncIterator[int]:
    """Indices 0..n-1 at gamma-distributed gaps (mean 1/rate; burstiness 1 is Poisson), as vLLM does;
    all at once when the rate is infinite."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if math.isinf(request_rate) or i == n - 1:
            continue
        theta = 1.0 / (request_rate * burstiness)
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))


# Cache counters of mmserve's /metrics (`mmserve:NAME_total`), all in tokens.
CACHE_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "mm_cache_queries", "mm_cache_hits")


async def scrape_cache_counters(client: Any, base_urls: Sequence[str]) -> dict[str, float] | None:
    """The cache counters of the servers at `base_urls` (every replica behind a router, or one server), summed
    over labels and servers; None when one's /metrics does not answer or lacks one (not an mmserve server).
    Server-wide: other clients' requests count too."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for base_url in base_urls:
        try:
            r = await client.get(f"{base_url}/metrics")
            if r.status_code != 200:
                return None
            families = list(text_string_to_metric_families(r.text))
        except (httpx.HTTPError, ValueError):
            return None
        found = set()
        for family in families:
            for sample in family.samples:
                name = sample.name.removeprefix("mmserve:").removesuffix("_total")
                if sample.name.startswith("mmserve:") and name in CACHE_COUNTERS:
                    values[name] = values.get(name, 0.0) + sample.value
                    found.add(name)
        if len(found) != len(CACHE_COUNTERS):
            return None
    return values


def cache_figures(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """What the server's caches did between two scrapes: tokens looked up and found in the prefix
    cache and the encoder (mm) cache, and each hit rate; every figure None when a scrape failed."""
    figures: dict[str, float | None] = {}
    for cache in ("prefix_cache", "mm_cache"):
        if before is None or after is None:
            queries = hits = None
        else:
            queries = after[f"{cache}_queries"] - before[f"{cache}_queries"]
            hits = after[f"{cache}_hits"] - before[f"{cache}_hits"]
        figures[f"server_{cache}_queries"] = queries
        figures[f"server_{cache}_hits"] = hits
        figures[f"server_{cache}_hit_rate"] = hits / queries if queries and hits is not None else None
    return figures


async def run_requests(
    url: str,
    requests: list[BenchRequest],
    transport: str,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    api_key: str | None = None,
    seed: int = 0,
    progress: bool = True,
    num_sockets: int | None = None,
    media_source: str = "data-url",
    first_alone: bool = False,
    video_interval_s: float = 2.0,
    metrics_urls: Sequence[str] | None = None,
) -> tuple[list[RequestTiming], float, dict]:
    """Send every request (one warm-up first, not counted); returns the timings (in `requests`' order),
    the duration and the server's cache figures over the run (`cache_figures`), summed over the servers at
    `metrics_urls` (default: `url`; behind a router, every replica).

    `first_alone`: request 0 goes alone and the rest wait for its first token (or its end) before the
    arrivals start, so request 0 is a cold miss whose prefix the others find cached.
    `late` requests (at the end of `requests`) are held back until every other request has its first
    token (or has ended), then sent one every `video_interval_s` seconds."""
    import httpx
    from tqdm import tqdm

    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose from {TRANSPORTS}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    bar = tqdm(total=len(requests), desc=f"bench serve ({transport})", disable=not progress)
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=limit + 4))
    pool = WSPool(url, num_sockets or min(limit, 64), api_key) if transport == "ws" else None
    try:
        if media_source == "upload":
            requests = await upload_media(client, url, requests, headers)
        if pool is not None:
            await pool.__aenter__()
            send: Callable[[BenchRequest, asyncio.Event | None], Any] = pool.send
        else:

            async def send(req: BenchRequest, first_token: asyncio.Event | None = None) -> RequestTiming:
                return await send_http(client, url, req, headers, first_token)

        # Warm-up on a text of its own: no prefix- or encoder-cache hits for the measured requests.
        warm = await send(BenchRequest([{"role": "user", "content": "Warm up."}], 2))
        if not warm.success:
            raise RuntimeError(f"warm-up request failed: {warm.error}")

        async def one(req: BenchRequest, first_token: asyncio.Event | None = None) -> RequestTiming:
            try:
                async with sem:
                    timing = await send(req, first_token)
            finally:  # a request that ends without a token must not hold the rest back
                if first_token is not None:
                    first_token.set()
            bar.update(1)
            return timing

        late = [i for i, r in enumerate(requests) if r.late]
        if late != list(range(len(requests) - len(late), len(requests))):
            raise ValueError("late requests must come last")
        before = await scrape_cache_counters(client, metrics_urls or [url])
        tasks = []
        start = time.perf_counter()
        rest = range(len(requests) - len(late))  # indices sent at the arrival times
        if first_alone and rest:
            first_token = asyncio.Event()
            tasks.append(asyncio.create_task(one(requests[0], first_token)))
            await first_token.wait()
            rest = rest[1:]
        streaming = {i: asyncio.Event() for i in rest} if late else {}
        async for i in arrivals(len(rest), request_rate, burstiness, seed):
            tasks.append(asyncio.create_task(one(requests[rest[i]], streaming.get(rest[i]))))
        if late:
            await asyncio.gather(*(event.wait() for event in streaming.values()))
            for j, i in enumerate(late):
                if j:
                    await asyncio.sleep(video_interval_s)
                tasks.append(asyncio.create_task(one(requests[i])))
        timings = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        figures = cache_figures(before, await scrape_cache_counters(client, metrics_urls or [url]))
    finally:
        bar.close()
        if pool is not None:
            await pool.__aexit__(None, None, None)
        await client.aclose()
    return list(timings), duration, figures


class InProcessServer:
    """`create_app` over a real `AsyncEngine`, served by uvicorn in a daemon thread on a free port."""

    def __init__(self, model: Path, **engine_kwargs: Any) -> None:
        from mmserve.api.app import create_app
        from mmserve.api.server import ServerThread
        from mmserve.api.settings import ServerSettings
        from mmserve.config import EngineArgs
        from mmserve.engine.async_engine import AsyncEngine

        self._tmp = tempfile.TemporaryDirectory(prefix="mmserve-bench-")
        self.engine = AsyncEngine(EngineArgs(str(model), **engine_kwargs), max_waiting_requests=1 << 20)
        settings = ServerSettings(data_dir=Path(self._tmp.name), served_model_name="bench")
        app = create_app(self.engine, settings)
        self.server = ServerThread(lambda: app, ws_max_size=settings.max_ws_message_bytes + 1024)
        self.url = self.server.url

    def close(self) -> None:
        self.server.stop()
        asyncio.run(self.engine.shutdown(1.0))
        self._tmp.cleanup()


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
    temporary file, whose tail is raised when the server fails to come up."""

    def __init__(
        self,
        model: Path,
        startup_timeout_s: float = 300.0,
        *,
        port: int | None = None,
        served_model_name: str = "bench",
        extra_args: Sequence[str] = (),
        wait: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        """`engine_kwargs`: EngineArgs fields that `mmserve serve` has flags for (None: its default);
        `extra_args`: more flags as given. `port` None: a free one. `wait` False: `wait_until_up` later."""
        self._tmp = tempfile.TemporaryDirectory(prefix="mmserve-bench-")
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.startup_timeout_s = startup_timeout_s
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
        env = {**os.environ, "MMSERVE_DATA_DIR": str(Path(self._tmp.name) / "data")}
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
        """Until /health answers 200; raises with the log's tail if the server exits or times out first."""
        assert self.proc is not None
        wait_until_healthy(self.proc, self.url, self.startup_timeout_s, self.log_path, "the server")

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


def offline_baseline(
    model: Path,
    requests: list[BenchRequest],
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_num_encoder_tokens: int | None = None,
) -> dict:
    """The same requests (messages, output lengths, greedy, ignore_eos) through the offline `LLM.chat`
    with the server's engine settings, in this process: the throughput the serving path is compared
    with, on exactly the same work. A warm-up request first, not counted."""
    from mmserve import LLM, SamplingParams

    llm = LLM(
        model,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_encoder_tokens=max_num_encoder_tokens,
    )
    llm.chat([{"role": "user", "content": "Warm up."}], SamplingParams(max_tokens=2, temperature=0.0))
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.chat([r.messages for r in requests], params)
    duration = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    return throughput_figures(len(outputs), prompt_tokens, output_tokens, duration)


def _load_tokenizer(model: Path | None) -> Any | None:
    if model is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def bench_serve(
    *,
    model: Path | None,
    url: str | None = None,
    transports: list[str] | tuple[str, ...] = ("ws",),
    workload: str = "random",
    num_prompts: int = 64,
    input_len: tuple[int, int] = (16, 128),
    output_len: tuple[int, int] = (16, 256),
    num_images: int | None = None,
    image_size: int = 64,
    prefix_len: int = 512,
    media_source: str = "data-url",
    num_frames: int = 0,
    video_size: int = 112,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    goodput_slos: dict[str, float] | None = None,
    api_key: str | None = None,
    seed: int = 0,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    max_num_encoder_tokens: int | None = None,
    num_videos: int = 2,
    video_interval_s: float = 2.0,
    compare_no_chunk: bool = False,
    server_process: bool = False,
    api_server_count: int = 1,
    engine_process: bool = True,
    image_format: str = "png",
    offline: bool = False,
    json_path: Path | None = None,
    progress: bool = True,
    metrics_urls: Sequence[str] | None = None,
) -> dict:
    """Run the workload over each transport; `url` None starts a server on `model`: in this process
    (a thread), or with `server_process` as a child `mmserve serve` (no GIL shared with the clients).

    `metrics_urls`: the servers whose /metrics give the cache figures, summed (with `url` a router: every
    replica behind it; a router answers /metrics from one replica); the engine-core loop figures are then
    reported only for a single one.

    `api_server_count`: with `server_process`, the child's API server processes (`--api-server-count`).

    `offline`: afterwards, the first transport's requests also run through the offline `LLM.chat` in this
    process, with `max_num_seqs` and `max_num_batched_tokens` (give the server's when it is at `url`), and
    each transport's throughputs are reported over the offline ones (`*_over_offline`).

    `long-video`: each transport's figures also carry `video_interference` (text ITL while the videos
    are in, against the rest). `compare_no_chunk` (servers it starts only) runs everything again on a
    server that prefills whole and encodes each video in one step, as vLLM without chunked prefill
    (token budget raised to the longest prompt), under the key "<transport>/no-chunk".

    Each transport gets its own draw of the workload (seed + its index): the same distribution, but
    no prompt, image or shared prefix of one transport is in the server's caches for the next. In
    `prefix`, request 0 is sent alone before the rest (see `run_requests`), so every transport's
    request 0 is a cold miss and the others repeat its prefix; their TTFTs are reported apart
    (`first_vs_repeats_ttft`)."""
    if media_source not in MEDIA_SOURCES:
        raise ValueError(f"unknown media source {media_source!r}; choose from {MEDIA_SOURCES}")
    num_images = resolve_num_images(workload, num_images)
    tokenizer = _load_tokenizer(model)

    def requests_for(index: int) -> list[BenchRequest]:
        return build_requests(
            workload,
            num_prompts,
            input_len,
            output_len,
            seed + index,
            tokenizer,
            num_images,
            image_size,
            prefix_len,
            num_frames,
            video_size,
            num_videos,
            image_format,
        )

    requests = requests_for(0)  # built before any server starts: bad workload options fail fast
    if url is None and model is None:
        raise ValueError("give --url or --model")
    if compare_no_chunk and (url is not None or workload != "long-video"):
        raise ValueError("--compare-no-chunk is for --workload long-video on servers it starts (no --url)")
    if (api_server_count != 1 or not engine_process) and (url is not None or not server_process):
        raise ValueError("--api-server-count and --no-engine-process are for the server --server-process starts")
    if url is not None and offline and model is None:
        raise ValueError("the offline baseline needs --model (the server's checkpoint)")
    engine_kwargs: dict[str, Any] = {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_num_encoder_tokens": max_num_encoder_tokens,
    }
    results: dict[str, dict] = {}
    raw: dict[str, list[dict]] = {}
    longest_prompt = 0
    for system in ("mmserve", "no-chunk") if compare_no_chunk else ("mmserve",):
        server: InProcessServer | ServerProcess | None = None
        if url is None:
            assert model is not None
            if system == "no-chunk":  # whole prefills need a budget that holds the longest prompt
                engine_kwargs |= {"scheduler_policy": "no_chunk", "chunk_encoder": False}
                engine_kwargs["max_num_batched_tokens"] = max(max_num_batched_tokens, longest_prompt)
            server = (
                ServerProcess(
                    model, **engine_kwargs, api_server_count=api_server_count, no_engine_process=not engine_process
                )
                if server_process
                else InProcessServer(model, **engine_kwargs)
            )
        base_url = (server.url if server is not None else str(url)).rstrip("/")
        loop_url = base_url if not metrics_urls else metrics_urls[0] if len(metrics_urls) == 1 else None
        try:
            for index, transport in enumerate(transports):
                if index and workload == "prefix":
                    requests = requests_for(index)
                loop_before = _core_loop(loop_url, api_key) if loop_url is not None else None
                timings, duration, cache = asyncio.run(
                    run_requests(
                        base_url,
                        requests,
                        transport,
                        request_rate,
                        burstiness,
                        max_concurrency,
                        api_key,
                        seed,
                        progress,
                        media_source=media_source,
                        first_alone=workload == "prefix",
                        video_interval_s=video_interval_s,
                        metrics_urls=metrics_urls,
                    )
                )
                longest_prompt = max([longest_prompt, *(t.prompt_tokens for t in timings)])
                key = transport if system == "mmserve" else f"{transport}/{system}"
                results[key] = _figures(workload, timings, duration, cache, goodput_slos, requests)
                loop_after = _core_loop(loop_url, api_key) if loop_url is not None else None
                if loop_after is not None:  # before the first step the server reports no loop times yet
                    results[key]["engine_core_loop"] = _loop_figures(loop_before, loop_after, duration)
                raw[key] = [
                    {
                        "ttft_s": t.ttft_s,
                        "tpot_s": t.tpot_s,
                        "e2el_s": t.e2el_s,
                        "itls_s": t.itls_s,
                        "output_tokens": t.output_tokens,
                        "success": t.success,
                    }
                    for t in timings
                ]
        finally:
            if server is not None:
                server.close()
    offline_figures = None
    if offline:
        assert model is not None
        offline_figures = offline_baseline(
            model, requests_for(0), max_num_seqs, max_num_batched_tokens, max_num_encoder_tokens
        )
        for metrics in results.values():
            for key in ("output_throughput", "total_token_throughput"):
                metrics[f"{key}_over_offline"] = metrics[key] / offline_figures[key]
    comparison = _chunk_comparison(results, transports[0]) if compare_no_chunk else None
    report = {
        "config": {
            "model": str(model) if model else None,
            "url": url,
            "in_process_server": url is None and not server_process,
            "server_process": server_process and url is None,
            "api_server_count": api_server_count if server_process and url is None else None,
            "engine_process": engine_process if server_process and url is None else None,
            "image_format": image_format if workload == "random-mm" else None,
            "transports": list(transports),
            "workload": workload,
            "num_prompts": num_prompts,
            "input_len": list(input_len),
            "output_len": list(output_len),
            "num_images": num_images,
            "image_size": image_size,
            "num_frames": num_frames if workload in ("random-mm", "long-video") else 0,
            "video_size": video_size if workload in ("random-mm", "long-video") and num_frames else None,
            "media_source": media_source if workload == "random-mm" or num_images else None,
            "prefix_len": prefix_len if workload == "prefix" else None,
            "first_request_alone": workload == "prefix",
            "request_rate": "inf" if math.isinf(request_rate) else request_rate,
            "burstiness": burstiness,
            "max_concurrency": max_concurrency,
            "goodput_slos_ms": goodput_slos,
            "seed": seed,
            "max_num_seqs": max_num_seqs if url is None or offline else None,
            "max_num_batched_tokens": max_num_batched_tokens if url is None or offline else None,
            "max_num_encoder_tokens": max_num_encoder_tokens,
            "num_videos": num_videos if workload == "long-video" else None,
            "video_interval_s": video_interval_s if workload == "long-video" else None,
            "compare_no_chunk": compare_no_chunk,
            # the no-chunk server's token budget: the longest prompt seen on the chunked one
            "no_chunk_max_num_batched_tokens": engine_kwargs["max_num_batched_tokens"]
            if compare_no_chunk
            else None,
        },
        "results": results,
        "offline": offline_figures,
        "chunk_vs_no_chunk": comparison,
        "requests": raw,
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
    return report


def _figures(
    workload: str,
    timings: list[RequestTiming],
    duration: float,
    cache: dict,
    goodput_slos: dict[str, float] | None,
    requests: list[BenchRequest],
) -> dict:
    """One transport's figures: vLLM's metrics, the workload's own, the server's cache hit rates, errors."""
    figures = compute_metrics(timings, duration, goodput_slos)
    if workload == "prefix":
        figures.update(first_vs_repeats_ttft(timings))
    if workload == "long-video":
        texts = [t for t, r in zip(timings, requests, strict=True) if not r.late]
        videos = [t for t, r in zip(timings, requests, strict=True) if r.late]
        figures.update(video_interference(texts, videos))
    figures.update(cache)
    figures["errors"] = sorted({t.error for t in timings if t.error})[:10]
    return figures


def _chunk_comparison(results: dict[str, dict], transport: str) -> dict | None:
    """long-video, chunked against no-chunk on `transport`: text ITL p99 and max while the videos were in,
    and output throughput (above 1: chunking costs throughput)."""
    chunk, whole = results.get(transport), results.get(f"{transport}/no-chunk")
    if chunk is None or whole is None:
        return None

    def ratio(key: str) -> float | None:
        a, b = chunk.get(key), whole.get(key)
        return a / b if a is not None and b else None

    return {
        "transport": transport,
        "p99_text_itl_in_window_chunk_over_no_chunk": ratio("text_itl_in_window_p99_ms"),
        "max_text_itl_in_window_chunk_over_no_chunk": ratio("text_itl_in_window_max_ms"),
        "output_throughput_no_chunk_over_chunk": (
            whole["output_throughput"] / chunk["output_throughput"] if chunk["output_throughput"] else None
        ),
    }


def _core_loop(base_url: str, api_key: str | None) -> dict[str, float] | None:
    """The engine-core process's loop counters from /metrics (None: the core runs in-process)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30).text
    except httpx.HTTPError:
        return None
    found: dict[str, float] = {}
    for line in text.splitlines():
        for part in ("step", "io", "idle"):
            if line.startswith("mmserve:engine_core_loop_seconds_total{") and f'part="{part}"' in line:
                found[part] = float(line.rsplit(" ", 1)[1])
        for name in ("engine_core_steps", "engine_core_bytes_out"):
            if line.startswith(f"mmserve:{name}_total{{"):
                found[name] = float(line.rsplit(" ", 1)[1])
    return found if len(found) == 5 else None


def _loop_figures(
    before: dict[str, float] | None, after: dict[str, float], duration_s: float
) -> dict[str, float | None]:
    """Over one timed run of `duration_s`: the shares of it the core loop spent inside steps and on
    messages (the rest it waited), and what crossing the boundary cost per step (the core's io:
    decoding messages in, encoding and sending outputs). `before` None: nothing had run yet."""
    d = {k: after[k] - (before[k] if before is not None else 0.0) for k in after}
    wall = duration_s
    steps = d["engine_core_steps"]
    return {
        "step_share": d["step"] / wall if wall else None,
        "io_share": d["io"] / wall if wall else None,
        "idle_share": max(0.0, 1.0 - (d["step"] + d["io"]) / wall) if wall else None,
        "steps": steps,
        "step_ms": 1e3 * d["step"] / steps if steps else None,
        "io_us_per_step": 1e6 * d["io"] / steps if steps else None,
        "bytes_out_per_step": d["engine_core_bytes_out"] / steps if steps else None,
        "io_over_step_time": d["io"] / d["step"] if d["step"] else None,
    }


def format_report(report: dict) -> str:
    from mmserve.bench.metrics import format_metrics

    parts = []
    for transport, metrics in report["results"].items():
        parts.append(f"== {transport} ==\n{format_metrics(metrics)}")
        if "ttft_first_ms" in metrics:
            parts.append(_format_first_vs_repeats(metrics))
        for cache, title in (("prefix_cache", "Prefix cache"), ("mm_cache", "Encoder cache")):
            rate = metrics.get(f"server_{cache}_hit_rate")
            if rate is not None:
                hits, queries = metrics[f"server_{cache}_hits"], metrics[f"server_{cache}_queries"]
                parts.append(
                    f"{title + ' hits (server):':<40}{rate:>12.1%} ({hits:.0f} of {queries:.0f} tokens)"
                )
        if metrics.get("video_window_s") is not None:
            parts.append(_format_video_interference(metrics))
        if "output_throughput_over_offline" in metrics:
            parts.append(
                f"{'Output / total tok/s over offline:':<40}{metrics['output_throughput_over_offline']:>12.3f}"
                f" / {metrics['total_token_throughput_over_offline']:.3f}"
            )
        loop = metrics.get("engine_core_loop")
        if loop:
            parts.append(
                f"{'Engine-core loop: step / io / idle:':<40}{_num(loop['step_share'], 3):>12} / "
                f"{_num(loop['io_share'], 3)} / {_num(loop['idle_share'], 3)}\n"
                f"{'Boundary per step: us / bytes out:':<40}{_num(loop['io_us_per_step'], 1):>12} / "
                f"{_num(loop['bytes_out_per_step'], 0)} (io / step time {_num(loop['io_over_step_time'], 4)})"
            )
        if metrics.get("errors"):
            parts.append("errors: " + "; ".join(metrics["errors"]))
    comparison = report.get("chunk_vs_no_chunk")
    if comparison:
        parts.append(
            f"== chunked / no-chunk ({comparison['transport']}) ==\n"
            f"{'p99 text ITL while videos are in:':<40}{_num(comparison['p99_text_itl_in_window_chunk_over_no_chunk'], 3):>12}\n"
            f"{'max text ITL while videos are in:':<40}{_num(comparison['max_text_itl_in_window_chunk_over_no_chunk'], 3):>12}\n"
            f"{'output tok/s, no-chunk / chunked:':<40}{_num(comparison['output_throughput_no_chunk_over_chunk'], 3):>12}"
        )
    offline = report.get("offline")
    if offline:
        parts.append(
            f"== offline LLM.chat, same requests ==\n{'Duration (s):':<40}{offline['duration_s']:>12.2f}\n"
            f"{'Output token throughput (tok/s):':<40}{offline['output_throughput']:>12.2f}\n"
            f"{'Total token throughput (tok/s):':<40}{offline['total_token_throughput']:>12.2f}"
        )
    return "\n".join(parts)


def _num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _format_video_interference(m: dict) -> str:
    """The long-video workload's lines: text ITL while the videos were in the server, and outside."""
    lines = [f"{'Videos in the server (s):':<40}{_num(m['video_window_s'], 2):>12}"]
    for where, title in (("in", "while videos are in"), ("out", "otherwise")):
        lines.append(
            f"{f'Text ITL {title} (ms):':<40}p50 {_num(m[f'text_itl_{where}_window_p50_ms'])}, "
            f"p99 {_num(m[f'text_itl_{where}_window_p99_ms'])}, "
            f"max {_num(m[f'text_itl_{where}_window_max_ms'])}"
        )
    lines.append(
        f"{'Video TTFT (ms):':<40}median {_num(m['video_ttft_median_ms'])}, max {_num(m['video_ttft_max_ms'])}"
    )
    return "\n".join(lines)


def _format_first_vs_repeats(m: dict) -> str:
    """The prefix workload's TTFT lines: request 0 (cold) against the repeats."""
    ratio = m["ttft_repeats_over_first"]
    return "\n".join(
        [
            f"{'TTFT of the first request (ms):':<40}{_num(m['ttft_first_ms']):>12}",
            f"{'TTFT of repeats (ms):':<40}median {_num(m['ttft_repeats_median_ms'])}, "
            f"p90 {_num(m['ttft_repeats_p90_ms'])}",
            f"{'TTFT repeats median / first:':<40}{_num(ratio, 3):>12}",
        ]
    )
