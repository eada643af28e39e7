"""The load runner every online `mmserve bench` command shares: the transports (streamed HTTP chat completions,
a pool of WebSocket chat sockets), media uploads, arrivals (a gamma process as `vllm bench serve`'s, or each
request's own offset), and the server's cache counters scraped from /metrics around a run. Produces one
`RequestTiming` per request; knows the wire formats of docs/api.md, never the engine's internals."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import itertools
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import numpy as np

from mmserve.bench.metrics import RequestTiming
from mmserve.bench.workload import Request

TRANSPORTS = ("ws", "http")


async def send_http(
    client: Any,
    base_url: str,
    req: Request,
    headers: dict,
    first_token: asyncio.Event | None = None,
    model: str = "bench",
) -> RequestTiming:
    """One streamed `POST /v1/chat/completions` naming `model`; each non-empty content delta's arrival is
    recorded, and `first_token` (if given) is set at the first."""
    body = {"model": model, **req.body(), "stream": True, "stream_options": {"include_usage": True}}
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

    async def send(self, req: Request, first_token: asyncio.Event | None = None) -> RequestTiming:
        """One `response.create`; each non-empty text delta's arrival is recorded, and `first_token` (if
        given) is set at the first."""
        rid = f"b{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue
        ws = self.sockets[next(self._next)]
        start = time.perf_counter()
        chunks: list[float] = []
        try:
            await ws.send(json.dumps({"type": "response.create", "response": {"id": rid, **req.body()}}))
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
    client: Any, base_url: str, requests: list[Request], headers: dict
) -> list[Request]:
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
        out.append(dataclasses.replace(req, messages=messages))
    return out


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model a server lists at /v1/models (what a peer must be asked for by name)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    models = r.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


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
    requests: list[Request],
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
    warm_up: bool = True,
    model: str = "bench",
) -> tuple[list[RequestTiming], float, dict]:
    """Send every request (with `warm_up`, one of its own first, not counted); returns the timings (in
    `requests`' order), the duration (first send to last end) and the server's cache figures over the run
    (`cache_figures`), summed over the servers at `metrics_urls` (default: `url`; behind a router, every replica).

    Requests go at the arrival process's times (`request_rate`, `burstiness`, `seed`), or, when they carry
    `at_s` (all of them), each at its own offset from the start.

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
    bar = tqdm(total=len(requests), desc=f"bench ({transport})", disable=not progress)
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=limit + 4))
    pool = WSPool(url, num_sockets or min(limit, 64), api_key) if transport == "ws" else None
    try:
        if media_source == "upload":
            requests = await upload_media(client, url, requests, headers)
        if pool is not None:
            await pool.__aenter__()
            send: Callable[[Request, asyncio.Event | None], Any] = pool.send
        else:

            async def send(req: Request, first_token: asyncio.Event | None = None) -> RequestTiming:
                return await send_http(client, url, req, headers, first_token, model)

        if warm_up:  # on a text of its own: no prefix- or encoder-cache hits for the measured requests
            warm = await send(Request([{"role": "user", "content": "Warm up."}], 2))
            if not warm.success:
                raise RuntimeError(f"warm-up request failed: {warm.error}")

        async def one(req: Request, first_token: asyncio.Event | None = None) -> RequestTiming:
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
        offsets = [r.at_s for r in requests if r.at_s is not None]
        if offsets and (len(offsets) != len(requests) or late or first_alone):
            raise ValueError("requests with send offsets (at_s) must all have one, none late, none first alone")
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

        async def at_offset(req: Request) -> RequestTiming:
            await asyncio.sleep(max(0.0, start + (req.at_s or 0.0) - time.perf_counter()))
            return await one(req)

        if offsets:
            tasks = [asyncio.create_task(at_offset(req)) for req in requests]
        else:
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
