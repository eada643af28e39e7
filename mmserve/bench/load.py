"""The load runner of every online `mmserve bench` command: the transports (streamed HTTP, pooled WebSockets),
media uploads, arrivals and the server's cache counters around a run; one `RequestTiming` per request. Knows
the wire formats of docs/api.md, never the engine's internals."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from mmserve.bench import TRANSPORTS
from mmserve.bench.metrics import RequestTiming, core_loop_figures, ratio
from mmserve.bench.workload import LENGTH_FORCINGS, Request, user

# On a text of its own: no prefix- or encoder-cache hits for the measured requests.
WARM_UP = Request(user("Warm up."), 2)
# send(request, first_token=None) -> its timing, `first_token` set at its first token: `send_http` bound to a
# client and server, or a `ws_pool`.
Send = Callable[..., Awaitable[RequestTiming]]


@dataclasses.dataclass
class _Stream:
    """One request's record as it streams: when it was sent and when each non-empty delta arrived;
    `first_token` (if given) is set at the first delta."""

    first_token: asyncio.Event | None
    start: float = dataclasses.field(default_factory=time.perf_counter)
    chunks: list[float] = dataclasses.field(default_factory=list)

    def delta(self, now: float) -> None:
        self.chunks.append(now)
        if self.first_token is not None:
            self.first_token.set()

    def done(self, end: float, usage: dict) -> RequestTiming:
        return RequestTiming(self.start, tuple(self.chunks), end, usage.get("prompt_tokens", 0),
                             usage.get("completion_tokens", len(self.chunks)))  # fmt: skip

    def failed(self, exc: Exception) -> RequestTiming:  # a failed request is a figure, not a crash
        error = f"{type(exc).__name__}: {exc}"
        return RequestTiming(self.start, tuple(self.chunks), time.perf_counter(), 0, 0, False, error)


async def send_http(client: Any, base_url: str, req: Request, headers: dict,
                    first_token: asyncio.Event | None = None, model: str = "bench",
                    length_forcing: str = "ignore_eos") -> RequestTiming:  # fmt: skip
    """One streamed `POST /v1/chat/completions` naming `model`, its length forced as `length_forcing` says
    (`Request.body`); each non-empty content delta's arrival is recorded, and `first_token` (if given) is set
    at the first."""
    body = {"model": model, **req.body(length_forcing), "stream": True, "stream_options": {"include_usage": True}}
    stream, usage = _Stream(first_token), {}
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                now = time.perf_counter()
                if line == "data: [DONE]":
                    break
                if not line.startswith("data: "):
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    raise RuntimeError(event["error"].get("message", "stream error"))
                if any(c.get("delta", {}).get("content") for c in event.get("choices", ())):
                    stream.delta(now)
                usage = event.get("usage") or usage
        return stream.done(time.perf_counter(), usage)
    except Exception as exc:
        return stream.failed(exc)


@contextlib.asynccontextmanager
async def ws_pool(url: str, size: int, api_key: str | None) -> AsyncIterator[Send]:
    """`size` WebSocket chat sessions (the SDK's `AsyncChatSession`) shared by all requests, as a `Send`: each
    request is one `response.create` on the next session in turn, its deltas timed as they reach it."""
    from mmserve.client.async_session import AsyncChatSession

    ids = itertools.count()

    async def send(req: Request, first_token: asyncio.Event | None = None) -> RequestTiming:
        stream = _Stream(first_token)
        try:
            response = await sessions[next(ids) % size].send(**req.body())
            async for delta in response:
                if delta:
                    stream.delta(time.perf_counter())
            if response.status == "failed" or response.result is None:
                raise RuntimeError(f"response failed: {response.result}")
            return stream.done(time.perf_counter(), response.usage.model_dump() if response.usage else {})
        except Exception as exc:
            return stream.failed(exc)

    async with contextlib.AsyncExitStack() as stack:
        sessions = [await stack.enter_async_context(AsyncChatSession(url, api_key, open_timeout=30.0))
                    for _ in range(size)]  # fmt: skip
        yield send


async def upload_media(base_url: str, requests: list[Request], api_key: str | None) -> list[Request]:
    """`--media-source upload`: upload each distinct data-URL image or video once (before timing, through the
    SDK's `files.create`) and refer to it by id; a URL repeated across requests (the prefix workload's images)
    shares one file."""
    from mmserve.client import AsyncClient

    file_ids: dict[str, str] = {}  # data URL -> uploaded file id
    async with AsyncClient(base_url, api_key, max_retries=0) as sdk:

        async def by_id(part: dict) -> dict:
            kind = part["type"]  # "text" | "image_url" | "video_url"
            url = part[kind]["url"] if kind != "text" else ""
            if not url.startswith("data:"):
                return part
            if url not in file_ids:
                file = ("bench.png" if kind == "image_url" else "bench.mp4", base64.b64decode(url.split(",", 1)[1]))
                file_ids[url] = (await sdk.files.create(file=file, purpose="vision")).id
            return {"type": kind, kind: {"url": file_ids[url]}}

        return [dataclasses.replace(r, messages=[  # a message's content: a text, or a list of parts
            {**m, "content": [await by_id(p) for p in m["content"]]} if isinstance(m["content"], list) else m
            for m in r.messages]) for r in requests]  # fmt: skip


def served_model(base_url: str) -> str:
    """The first model a server lists at /v1/models (what a peer must be asked for by name)."""
    import httpx

    r = httpx.get(f"{base_url}/v1/models", timeout=30)
    r.raise_for_status()
    models = r.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


def length_forcing(base_url: str, model: str) -> str:
    """How the server at `base_url` takes a forced output length (one of LENGTH_FORCINGS): the first it accepts of
    a 2-token request that carries it and answers with 2 tokens. Raises if it takes none (its figures would
    compare outputs of other lengths)."""
    import httpx

    probe = Request(user("Say something."), 2)
    answers = []
    for forcing in LENGTH_FORCINGS:
        try:
            r = httpx.post(f"{base_url}/v1/chat/completions", json={"model": model, **probe.body(forcing)}, timeout=120)
            body = r.json() if r.status_code == 200 else None
            tokens = (body.get("usage") or {}).get("completion_tokens") if isinstance(body, dict) else None
        except (httpx.HTTPError, ValueError) as exc:  # unreachable, or an answer that is not JSON
            answers.append(f"{forcing}: {type(exc).__name__}: {exc}")
            continue
        if tokens == probe.output_len:
            return forcing
        answers.append(f"{forcing}: HTTP {r.status_code}, {tokens} tokens, {r.text[:120]!r}")
    raise RuntimeError(f"{base_url} forces no output length the ways the bench knows: " + "; ".join(answers))


async def scrape_counters(client: Any, base_url: str, headers: dict[str, str]) -> dict[str, float]:
    """The server's counters from its /metrics (`mmserve:NAME_total`), by NAME summed over their labels but
    `part` (the engine-core loop's seconds: `engine_core_loop_seconds:step`...); {} when /metrics does not
    answer (not an mmserve server). Server-wide: other clients' requests count too."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get(f"{base_url}/metrics", headers=headers)
        r.raise_for_status()
        samples = [s for family in text_string_to_metric_families(r.text) for s in family.samples]
    except (httpx.HTTPError, ValueError):
        return {}
    counters: dict[str, float] = {}
    for sample in samples:
        if sample.name.startswith("mmserve:") and sample.name.endswith("_total"):
            name = sample.name.removeprefix("mmserve:").removesuffix("_total")
            name += f":{sample.labels['part']}" if "part" in sample.labels else ""
            counters[name] = counters.get(name, 0.0) + sample.value
    return counters


def cache_figures(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]) -> dict:
    """What the servers' caches did between two scrapes of each (`scrape_counters`), summed over the servers:
    tokens looked up and found in the prefix cache and the encoder (mm) cache, and each hit rate; every figure
    None when a scrape lacks a counter (a server that did not answer, or is not mmserve)."""
    caches, kinds = ("prefix_cache", "mm_cache"), ("queries", "hits")  # all in tokens
    complete = all(f"{cache}_{k}" in c for c in (*before, *after) for cache in caches for k in kinds)
    figures: dict[str, float | None] = {}
    for cache in caches:
        queries, hits = ((sum(a[f"{cache}_{k}"] - b[f"{cache}_{k}"] for a, b in zip(after, before, strict=True))
                          for k in kinds) if complete else (None, None))  # fmt: skip
        figures |= {f"server_{cache}_queries": queries, f"server_{cache}_hits": hits,
                    f"server_{cache}_hit_rate": ratio(hits, queries)}  # fmt: skip
    return figures


async def run_requests(
    url: str, requests: list[Request], transport: str, request_rate: float = math.inf,
    burstiness: float = 1.0, max_concurrency: int | None = None, api_key: str | None = None, seed: int = 0,
    progress: bool = True, media_source: str = "data-url",
    first_alone: bool = False, video_interval_s: float = 2.0, metrics_urls: Sequence[str] | None = None,
    warm_up: bool = True, model: str = "bench", loop_url: str | None = None, length_forcing: str = "ignore_eos",
) -> tuple[list[RequestTiming], float, dict]:  # fmt: skip
    """Send every request (with `warm_up`, WARM_UP first, not counted); returns the timings (in `requests`'
    order), the duration (first send to last end) and the server's figures over that span: its cache figures
    (`cache_figures`) summed over the servers at `metrics_urls` (default: `url`; behind a router, every replica),
    and with `loop_url` the engine-core loop of the server there (`core_loop_figures`, when it reports one).

    Requests go at the arrival process's times (`request_rate`, `burstiness`, `seed`), or, when they carry
    `at_s` (all of them), each at its own offset from the start. `first_alone`: request 0 goes alone and the
    rest wait for its first token (or its end), so it is a cold miss whose prefix the others find cached.
    `late` requests (at the end of `requests`) are held back until every other request has its first
    token (or has ended), then sent one every `video_interval_s` seconds. `length_forcing` (HTTP): how output
    lengths are forced on the server (`Request.body`)."""
    import httpx
    from tqdm import tqdm

    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose from {TRANSPORTS}")
    late = [i for i, r in enumerate(requests) if r.late]
    timed = range(len(requests) - len(late))  # indices sent at the arrival times (or their own offsets)
    if late != list(range(len(timed), len(requests))):
        raise ValueError("late requests must come last")
    offsets = [r.at_s for r in requests if r.at_s is not None]
    if offsets and (len(offsets) != len(requests) or late or first_alone):
        raise ValueError("requests with send offsets (at_s) must all have one, none late, none first alone")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests)
    sem = asyncio.Semaphore(limit)
    first_tokens = [asyncio.Event() for _ in requests]  # each set at its request's first token, or at its end
    async with contextlib.AsyncExitStack() as stack:
        bar = stack.enter_context(tqdm(total=len(requests), desc=f"bench ({transport})", disable=not progress))
        limits = httpx.Limits(max_connections=limit + 4)
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=None, limits=limits))
        if media_source == "upload":
            requests = await upload_media(url, requests, api_key)
        send: Send = (await stack.enter_async_context(ws_pool(url, min(limit, 64), api_key)) if transport == "ws"
                      else functools.partial(send_http, client, url, headers=headers, model=model,
                                             length_forcing=length_forcing))  # fmt: skip
        if warm_up and not (warm := await send(WARM_UP)).success:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        cache_urls = list(dict.fromkeys(metrics_urls or [url]))
        scraped = set(cache_urls) | ({loop_url} if loop_url else set())  # the servers whose counters count
        before = {u: await scrape_counters(client, u, headers) for u in scraped}
        start = time.perf_counter()

        async def one(i: int) -> RequestTiming:
            if (at_s := requests[i].at_s) is not None:
                await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
            try:
                async with sem:
                    return await send(requests[i], first_token=first_tokens[i])
            finally:  # a request that ends without a token must not hold the rest back
                first_tokens[i].set()
                bar.update(1)

        tasks = []
        if first_alone and timed:
            tasks.append(asyncio.create_task(one(0)))
            await first_tokens[0].wait()
            timed = timed[1:]
        rng = np.random.default_rng(seed)  # gamma-distributed gaps (mean 1/rate; burstiness 1: Poisson), as vLLM
        for k, i in enumerate(timed):  # all at once at an infinite rate, or with offsets (each waits its own)
            tasks.append(asyncio.create_task(one(i)))
            if not (offsets or math.isinf(request_rate)) and k < len(timed) - 1:
                await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness))))
        if late:
            await asyncio.gather(*(first_tokens[i].wait() for i in timed))
            for j, i in enumerate(late):
                await asyncio.sleep(video_interval_s if j else 0.0)
                tasks.append(asyncio.create_task(one(i)))
        timings = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = {u: await scrape_counters(client, u, headers) for u in scraped}
    figures = cache_figures([before[u] for u in cache_urls], [after[u] for u in cache_urls])
    if loop_url is not None:  # the loop's figures where its core reports them (a core in its own process)
        figures |= core_loop_figures(before[loop_url], after[loop_url], duration)
    return list(timings), duration, figures
