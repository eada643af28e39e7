"""`python -m tests.soak` (`make soak`): minutes of mixed traffic against a live server — text,
images and video; JSON, SSE and WebSocket; random cancellations and disconnects at set rates — then a
report: requests by outcome, p50/p99 latencies, unintended errors (must be 0), KV blocks and encoder
cache references held at the end (must be 0), resident memory after warm-up and at the end (< 10%).

Against an in-process server (tiny model made on the fly, or --model) it reads the engine's own
counters and the process's memory; against --url only what /metrics shows. Knows the wire formats of
docs/api.md; looks inside the engine only for the end-of-run accounting.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ASSETS = Path(__file__).resolve().parent.parent / "assets"
_WORDS = (
    "the a red blue green circle square image video frame token cache block decode prefill model "
    "server request stream latency batch of in on with and to is what why how describe count"
).split()
# Outcomes a soak client means to cause; anything else (an error event, a 5xx, a hang) is unintended.
INTENDED = ("completed", "cancelled", "disconnected", "rejected")


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 180.0
    concurrency: int = 8
    cancel_rate: float = 0.15  # the client cancels (WS response.cancel / closes the SSE stream) mid-way
    disconnect_rate: float = 0.10  # the client drops the connection mid-way without a word
    image_rate: float = 0.25
    video_rate: float = 0.10
    max_tokens: tuple[int, int] = (4, 48)
    warmup_s: float | None = None  # default: 20% of the run, at most 30 s
    seed: int = 0
    url: str | None = None
    api_key: str | None = None


@dataclass
class SoakReport:
    duration_s: float
    requests: int
    outcomes: dict[str, int]
    by_kind: dict[str, int]
    latency_p50_s: float | None
    latency_p99_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    unintended_errors: int
    error_samples: list[str]
    num_running_end: int | None
    kv_blocks_held_end: int | None
    encoder_tokens_referenced_end: int | None
    encoder_entries_cached_end: int | None  # entries cached (unreferenced ones may stay)
    rss_start_mib: float | None  # after warm-up
    rss_end_mib: float | None
    rss_growth: float | None  # fraction
    passed: bool = False
    failures: list[str] = field(default_factory=list)


def _data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def _rss_mib() -> float | None:
    try:
        for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class _Traffic:
    """The soak's clients: each call runs one request end to end and returns (outcome, kind, e2e, ttft)."""

    def __init__(self, cfg: SoakConfig, base_url: str, model: str) -> None:
        self.cfg, self.base_url, self.model = cfg, base_url, model
        self.ws_url = base_url.replace("http", "ws", 1) + "/v1/chat/ws"
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.image = _data_url(ASSETS / "sample.jpg", "image/jpeg")
        self.video = _data_url(ASSETS / "sample_clip.mp4", "video/mp4")
        self.errors: list[str] = []

    def body(self, rng: random.Random) -> tuple[str, dict[str, Any]]:
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 40)))
        r = rng.random()
        content: Any = words
        media = "text"
        if r < self.cfg.video_rate:
            media, content = (
                "video",
                [{"type": "video_url", "video_url": {"url": self.video}}, {"type": "text", "text": words}],
            )
        elif r < self.cfg.video_rate + self.cfg.image_rate:
            media, content = (
                "image",
                [{"type": "image_url", "image_url": {"url": self.image}}, {"type": "text", "text": words}],
            )
        lo, hi = self.cfg.max_tokens
        return media, {
            "model": self.model, "messages": [{"role": "user", "content": content}],
            "max_tokens": rng.randint(lo, hi), "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True,
        }  # fmt: skip

    def fate(self, rng: random.Random) -> str:
        r = rng.random()
        if r < self.cfg.cancel_rate:
            return "cancel"
        if r < self.cfg.cancel_rate + self.cfg.disconnect_rate:
            return "disconnect"
        return "complete"

    def _error(self, what: str) -> str:
        if len(self.errors) < 20:
            self.errors.append(what[:300])
        return "error"

    async def http_json(self, client: httpx.AsyncClient, body: dict, fate: str, rng: random.Random) -> str:
        if fate != "complete":  # a plain request can only be abandoned: time out before the answer
            with contextlib.suppress(httpx.TimeoutException):
                r = await client.post("/v1/chat/completions", json=body, timeout=rng.uniform(0.01, 0.3))
                return self._check_json(r)
            return "disconnected"
        return self._check_json(await client.post("/v1/chat/completions", json=body, timeout=300))

    def _check_json(self, r: httpx.Response) -> str:
        if r.status_code == 429:
            return "rejected"
        if r.status_code != 200 or r.json()["choices"][0]["finish_reason"] != "length":
            return self._error(f"http {r.status_code}: {r.text}")
        return "completed"

    async def http_sse(
        self,
        client: httpx.AsyncClient,
        body: dict,
        fate: str,
        rng: random.Random,
        t0: float,
        ttft: list[float],
    ) -> str:
        stop_after = rng.randint(1, max(1, body["max_tokens"])) if fate != "complete" else None
        async with client.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}, timeout=300
        ) as r:
            if r.status_code == 429:
                return "rejected"
            if r.status_code != 200:
                return self._error(f"sse {r.status_code}: {(await r.aread()).decode(errors='replace')}")
            seen = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "completed"
                event = json.loads(line[6:])
                if "error" in event:
                    return self._error(f"sse error event: {event}")
                if not ttft and event["choices"] and event["choices"][0]["delta"].get("content"):
                    ttft.append(time.monotonic() - t0)
                seen += 1
                if stop_after is not None and seen >= stop_after:
                    return "cancelled" if fate == "cancel" else "disconnected"  # closing the stream hangs up
        return self._error("sse stream ended without [DONE]")

    async def ws(self, body: dict, fate: str, rng: random.Random, t0: float, ttft: list[float]) -> str:
        from websockets.asyncio.client import connect

        stop_after = rng.randint(1, max(1, body["max_tokens"])) if fate != "complete" else None
        async with connect(self.ws_url, additional_headers=self.headers, max_size=None) as ws:
            if json.loads(await ws.recv())["type"] != "session.created":
                return self._error("ws: no session.created")
            await ws.send(json.dumps({"type": "response.create", "response": {"id": "r", **body}}))
            seen = 0
            async for raw in ws:
                event = json.loads(raw)
                kind = event["type"]
                if kind == "response.output_text.delta":
                    if not ttft:
                        ttft.append(time.monotonic() - t0)
                    seen += 1
                    if stop_after is not None and seen >= stop_after:
                        if fate == "disconnect":
                            return "disconnected"  # leaving the block closes the socket mid-stream
                        await ws.send(json.dumps({"type": "response.cancel", "response_id": "r"}))
                        stop_after = None
                elif kind == "response.done":
                    status = event["response"]["status"]
                    if status == "cancelled" and fate == "cancel":
                        return "cancelled"
                    if status == "incomplete":
                        return "completed"  # max_tokens reached (ignore_eos)
                    return self._error(f"ws response.done {status}: {event}")
                elif kind == "error":
                    if event["error"].get("code") in ("too_many_concurrent_requests", "queue_full"):
                        return "rejected"
                    return self._error(f"ws error event: {event}")
        return self._error("ws closed before response.done")


async def _drive(cfg: SoakConfig, traffic: _Traffic, deadline: float, results: list[dict]) -> None:
    async with httpx.AsyncClient(base_url=traffic.base_url, headers=traffic.headers) as client:

        async def worker(index: int) -> None:
            rng = random.Random(cfg.seed * 1000 + index)
            while time.monotonic() < deadline:
                media, body = traffic.body(rng)
                fate = traffic.fate(rng)
                transport = rng.choice(["json", "sse", "ws", "ws"])
                t0 = time.monotonic()
                ttft: list[float] = []
                try:
                    if transport == "json":
                        outcome = await traffic.http_json(client, body, fate, rng)
                    elif transport == "sse":
                        outcome = await traffic.http_sse(client, body, fate, rng, t0, ttft)
                    else:
                        outcome = await traffic.ws(body, fate, rng, t0, ttft)
                except Exception as exc:  # a transport failure the client did not cause
                    outcome = traffic._error(f"{transport}: {type(exc).__name__}: {exc}")
                results.append({
                    "outcome": outcome, "kind": f"{transport}/{media}", "e2e": time.monotonic() - t0,
                    "ttft": ttft[0] if ttft else None, "end": time.monotonic(),
                })  # fmt: skip

        await asyncio.gather(*(worker(i) for i in range(cfg.concurrency)))


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f"mmserve:{name}{{") or line.startswith(f"mmserve:{name} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def run_soak(cfg: SoakConfig, model: Path | None = None, progress: bool = True) -> SoakReport:
    server = None
    tmp = None
    engine = None
    if cfg.url is None:
        from mmserve.bench.servers import InProcessServer

        if model is None:
            from mmserve.tiny_model import make_tiny_model

            tmp = tempfile.TemporaryDirectory(prefix="mmserve-soak-")
            model = make_tiny_model(Path(tmp.name) / "tiny", arch="qwen2_vl", preset="tiny", seed=0)
        server = InProcessServer(model, max_num_batched_tokens=256, max_model_len=4096, num_kv_blocks=512)
        engine = server.engine
        base_url, model_name = server.url, "bench"
    else:
        base_url, model_name = cfg.url.rstrip("/"), httpx.get(f"{cfg.url.rstrip('/')}/v1/models",
                                    headers={"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {},
                                    timeout=30).json()["data"][0]["id"]  # fmt: skip
    traffic = _Traffic(cfg, base_url, model_name)
    results: list[dict] = []
    warmup = cfg.warmup_s if cfg.warmup_s is not None else min(30.0, 0.2 * cfg.duration_s)
    start = time.monotonic()
    deadline = start + cfg.duration_s
    rss_start: list[float | None] = []

    async def main() -> None:
        async def sample_after_warmup() -> None:
            await asyncio.sleep(warmup)
            rss_start.append(_rss_mib() if server is not None else None)

        async def show_progress() -> None:
            while progress and time.monotonic() < deadline:
                await asyncio.sleep(10)
                counts = Counter(r["outcome"] for r in results)
                print(
                    f"  soak: {time.monotonic() - start:5.0f} s  {dict(counts)}", file=sys.stderr, flush=True
                )

        tasks = [asyncio.create_task(sample_after_warmup()), asyncio.create_task(show_progress())]
        await _drive(cfg, traffic, deadline, results)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run(main())
        elapsed = time.monotonic() - start
        # Let the aborts of the last disconnects reach the engine, then account for what is held.
        running = kv_held = enc_refs = enc_cached = None
        idle_deadline = time.monotonic() + 30
        while True:
            if engine is not None:
                stats = engine.stats()
                running = engine.num_in_flight + stats.num_running + stats.num_waiting
                kv_held = stats.num_total_blocks - stats.num_free_blocks
                enc_refs = stats.num_referenced_encoder_tokens
                enc_cached = stats.num_encoder_cache_entries
            else:
                text = httpx.get(f"{base_url}/metrics", timeout=30).text
                running = int(
                    (_metric(text, "num_requests_running") or 0)
                    + (_metric(text, "num_requests_waiting") or 0)
                )
                usage = _metric(text, "kv_cache_usage_perc")
                kv_held = None if usage is None else int(usage > 0)
            if (running == 0 and not kv_held and not enc_refs) or time.monotonic() > idle_deadline:
                break
            time.sleep(0.1)
        rss_end = _rss_mib() if server is not None else None
    finally:
        if server is not None:
            server.close()
        if tmp is not None:
            tmp.cleanup()
    outcomes = Counter(r["outcome"] for r in results)
    e2e = [r["e2e"] for r in results if r["outcome"] == "completed"]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    start_rss = rss_start[0] if rss_start else None
    growth = (rss_end - start_rss) / start_rss if rss_end is not None and start_rss else None
    report = SoakReport(
        duration_s=round(elapsed, 1),
        requests=len(results),
        outcomes=dict(sorted(outcomes.items())),
        by_kind=dict(sorted(Counter(r["kind"] for r in results).items())),
        latency_p50_s=_pct(e2e, 50), latency_p99_s=_pct(e2e, 99),
        ttft_p50_s=_pct(ttfts, 50), ttft_p99_s=_pct(ttfts, 99),
        unintended_errors=outcomes.get("error", 0),
        error_samples=traffic.errors,
        num_running_end=running, kv_blocks_held_end=kv_held,
        encoder_tokens_referenced_end=enc_refs, encoder_entries_cached_end=enc_cached,
        rss_start_mib=start_rss, rss_end_mib=rss_end, rss_growth=growth,
    )  # fmt: skip
    if report.unintended_errors:
        report.failures.append(f"{report.unintended_errors} unintended errors")
    if running:
        report.failures.append(f"{running} requests still in the engine")
    if kv_held:
        report.failures.append(f"{kv_held} KV blocks still held")
    if enc_refs:
        report.failures.append(f"{enc_refs} encoder cache tokens still referenced")
    if growth is not None and growth >= 0.10:
        report.failures.append(f"resident memory grew {growth:.1%} after warm-up")
    report.passed = not report.failures
    return report


def format_report(report: SoakReport) -> str:
    def s(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f} s"

    def mib(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.0f} MiB"

    lines = [
        f"soak: {report.requests} requests in {report.duration_s} s",
        "  outcomes:        " + ", ".join(f"{k} {v}" for k, v in report.outcomes.items()),
        "  by kind:         " + ", ".join(f"{k} {v}" for k, v in report.by_kind.items()),
        f"  latency (completed, e2e): p50 {s(report.latency_p50_s)}  p99 {s(report.latency_p99_s)}",
        f"  time to first token:      p50 {s(report.ttft_p50_s)}  p99 {s(report.ttft_p99_s)}",
        f"  unintended errors: {report.unintended_errors}",
        *(f"    {e}" for e in report.error_samples),
        f"  at the end: {report.num_running_end} requests in the engine, {report.kv_blocks_held_end} KV blocks held, "
        f"{report.encoder_tokens_referenced_end} encoder cache tokens referenced "
        f"({report.encoder_entries_cached_end} entries cached)",
        f"  resident memory: {mib(report.rss_start_mib)} after warm-up -> {mib(report.rss_end_mib)} at the end"
        + ("" if report.rss_growth is None else f" ({report.rss_growth:+.1%})"),
        "  PASS" if report.passed else "  FAIL: " + "; ".join(report.failures),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=180.0)
    p.add_argument("--concurrency", type=int, default=8, help="clients sending one request after another")
    p.add_argument("--cancel-rate", type=float, default=0.15)
    p.add_argument("--disconnect-rate", type=float, default=0.10)
    p.add_argument("--image-rate", type=float, default=0.25)
    p.add_argument("--video-rate", type=float, default=0.10)
    p.add_argument(
        "--warmup-s", type=float, default=None, help="memory is measured from here (default 20%%, <= 30 s)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="a running server (default: one in-process on a tiny model)")
    p.add_argument("--model", type=Path, default=None, help="checkpoint for the in-process server")
    p.add_argument("--api-key", default=os.environ.get("MMSERVE_API_KEY"))
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    cfg = SoakConfig(
        duration_s=args.duration_s, concurrency=args.concurrency, cancel_rate=args.cancel_rate,
        disconnect_rate=args.disconnect_rate, image_rate=args.image_rate, video_rate=args.video_rate,
        warmup_s=args.warmup_s, seed=args.seed, url=args.url, api_key=args.api_key,
    )  # fmt: skip
    report = run_soak(cfg, args.model)
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(report), indent=2))
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
