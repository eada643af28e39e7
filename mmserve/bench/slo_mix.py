"""`mmserve bench serve --workload slo-mix`: interactive chats (short text, single images) arriving as a
Poisson process over a backlog of batch jobs (long prompts, multi-image, long videos), at several chat
loads, under the `fcfs`, `priority` and `slo` policies in the same run (one in-process server per policy
on the same model, the same requests at the same offsets). Reports per class TTFT / TPOT percentiles,
interactive SLO attainment, goodput and batch throughput. Speaks the HTTP API only (service_tier
"flex" and priority 1 mark batch work), never the engine's internals."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmserve.bench.metrics import PERCENTILES, RequestTiming, meets_slos, summarize_ms
from mmserve.bench.serve import BenchRequest, _load_tokenizer, _png_data_url, _random_text, send_http

POLICIES = ("fcfs", "priority", "slo")
INTERACTIVE, BATCH = "interactive", "batch"


@dataclass(frozen=True)
class MixConfig:
    """One slo-mix run. Loads are chat arrival rates (req/s); each load runs `duration_s` of chats over a
    fresh backlog of `num_batch` batch jobs sent at its start."""

    loads: tuple[float, ...] = (0.5, 1.0, 2.0)
    duration_s: float = 20.0
    num_batch: int = 6  # cycled over long text, multi-image, long video
    chat_input_len: tuple[int, int] = (16, 64)
    chat_output_len: tuple[int, int] = (16, 32)
    chat_image_share: float = 0.5  # of chats, the share with one image
    batch_input_len: tuple[int, int] = (768, 1024)  # long-text jobs (approximate tokens)
    batch_output_len: tuple[int, int] = (32, 64)
    batch_images: int = 4  # per multi-image job
    image_size: int = 112  # chat and batch images (pixels per side)
    video_frames: int = 32  # frames kept of each long video (2 fps sampling: a 16 s clip)
    video_size: int = 112
    ttft_ms: float = 1000.0  # interactive targets: the server's class defaults and the attainment bar
    tbt_ms: float = 100.0
    policies: tuple[str, ...] = POLICIES
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    step_time_model: str | None = None  # `mmserve bench profile` JSON for the slo policy
    step_time_headroom: float = 0.1  # the slo policy plans steps to (1 - this) x the TBT target
    tbt_slack_ms: float = 0.0  # the slo policy's lend of a stream's lead on its TBT pace
    batch_min_share: float = 0.1  # the slo policy's share of each step kept for batch work
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.loads or any(not (x > 0 and math.isfinite(x)) for x in self.loads):
            raise ValueError("slo-mix: loads must be positive finite chat rates (req/s)")
        if set(self.policies) - set(POLICIES) or not self.policies:
            raise ValueError(f"slo-mix: policies must be among {POLICIES}")


# --quick: a smoke run of the whole pipeline (each policy, one load, a few requests) on the tiny model.
QUICK_MIX = MixConfig(
    loads=(2.0,), duration_s=2.0, num_batch=3, chat_input_len=(8, 16), chat_output_len=(2, 4),
    batch_input_len=(48, 64), batch_output_len=(2, 4), batch_images=2, image_size=56, video_frames=4,
    video_size=56, ttft_ms=60_000.0, tbt_ms=60_000.0, max_num_batched_tokens=128, max_num_seqs=16,
)  # fmt: skip


@dataclass(frozen=True)
class MixRequest:
    service_class: str  # INTERACTIVE | BATCH
    kind: str  # text | image | long-text | multi-image | video
    messages: list[dict]
    output_len: int
    at_s: float  # send offset from the start of the load's phase

    def body(self) -> dict[str, Any]:
        """Identical for every policy: fcfs ignores both marks, priority reads `priority`, slo `service_tier`."""
        batch = self.service_class == BATCH
        return {
            "messages": self.messages, "max_tokens": self.output_len, "temperature": 0.0, "ignore_eos": True,
            "service_tier": "flex" if batch else "default", "priority": 1 if batch else 0,
        }  # fmt: skip


def _mp4_data_url(rng: np.random.Generator, num_frames: int, size: int) -> str:
    """A `num_frames / 2` s clip at 2 fps (the server samples 2 fps: every frame is kept), smooth
    colour fields that drift, so it encodes small."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=2)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        base = rng.integers(0, 255, 3)
        ramp = np.linspace(0, 255, size, dtype=np.float64)
        for i in range(num_frames):
            pixels = np.empty((size, size, 3), dtype=np.uint8)
            for c in range(3):
                pixels[..., c] = (
                    (ramp[None, :] + ramp[:, None] * (c + 1) / 3 + base[c] + 9 * i) % 256
                ).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


def build_mix(cfg: MixConfig, load: float, seed: int, tokenizer: Any | None) -> list[MixRequest]:
    """The batch backlog (all at offset 0) then the chats at Poisson offsets within `duration_s`."""
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    out = []
    for i in range(cfg.num_batch):
        kind = ("long-text", "multi-image", "video")[i % 3]
        text = "Summarise this document.\n" + _random_text(rng, rng.randint(*cfg.batch_input_len), tokenizer)
        if kind == "multi-image":
            parts = [{"type": "image_url", "image_url": {"url": _png_data_url(np_rng, cfg.image_size)}}
                     for _ in range(cfg.batch_images)]  # fmt: skip
            content: str | list[dict] = [*parts, {"type": "text", "text": "Compare these images."}]
        elif kind == "video":
            url = _mp4_data_url(np_rng, cfg.video_frames, cfg.video_size)
            content = [{"type": "video_url", "video_url": {"url": url}},
                       {"type": "text", "text": "Describe what happens in the video."}]  # fmt: skip
        else:
            content = text
        messages = [{"role": "user", "content": content}]
        out.append(MixRequest(BATCH, kind, messages, rng.randint(*cfg.batch_output_len), 0.0))
    t = 0.0
    while True:
        t += float(np_rng.exponential(1.0 / load))
        if t >= cfg.duration_s:
            break
        text = _random_text(rng, rng.randint(*cfg.chat_input_len), tokenizer)
        if rng.random() < cfg.chat_image_share:
            content = [{"type": "image_url", "image_url": {"url": _png_data_url(np_rng, cfg.image_size)}},
                       {"type": "text", "text": text}]  # fmt: skip
            kind = "image"
        else:
            content, kind = text, "text"
        messages = [{"role": "user", "content": content}]
        out.append(MixRequest(INTERACTIVE, kind, messages, rng.randint(*cfg.chat_output_len), t))
    return out


async def run_phase(
    url: str, requests: list[MixRequest]
) -> tuple[list[tuple[MixRequest, RequestTiming]], float]:
    """Send each request at its offset over streamed HTTP; returns (request, timing) pairs and the
    phase's duration (first send to last finish)."""
    import httpx

    async with httpx.AsyncClient(
        timeout=None, limits=httpx.Limits(max_connections=len(requests) + 4)
    ) as client:

        async def one(req: MixRequest, start: float) -> RequestTiming:
            await asyncio.sleep(max(0.0, start + req.at_s - time.perf_counter()))
            wire = req.body()
            extra = {k: wire[k] for k in ("service_tier", "priority")}
            return await send_http(client, url, BenchRequest(req.messages, req.output_len, extra), {})

        start = time.perf_counter()
        timings = await asyncio.gather(*(one(r, start) for r in requests))
        duration = max((t.end_s for t in timings), default=start) - start
    return list(zip(requests, timings, strict=True)), duration


def phase_metrics(pairs: list[tuple[MixRequest, RequestTiming]], duration_s: float, cfg: MixConfig) -> dict:
    """Per class figures of one (policy, load) phase."""
    out: dict[str, Any] = {"duration_s": duration_s}
    for name in (INTERACTIVE, BATCH):
        timings = [t for r, t in pairs if r.service_class == name]
        ok = [t for t in timings if t.success]
        m: dict[str, Any] = {"requests": len(timings), "completed": len(ok), "failed": len(timings) - len(ok)}
        m.update(summarize_ms([t.ttft_s for t in ok if t.ttft_s is not None], "ttft", PERCENTILES))
        m.update(summarize_ms([t.tpot_s for t in ok if t.tpot_s is not None], "tpot", PERCENTILES))
        m["tokens"] = sum(t.prompt_tokens + t.output_tokens for t in ok)
        m["output_tokens"] = sum(t.output_tokens for t in ok)
        if name == INTERACTIVE:
            # vLLM's goodput rule: TBT is judged on the request's TPOT (one token: 0).
            good = sum(meets_slos(t, {"ttft": cfg.ttft_ms, "tpot": cfg.tbt_ms}) for t in timings)
            m["slo_attainment"] = good / len(timings) if timings else None
            m["goodput_rps"] = good / duration_s
        else:
            # Batch work is served when it is done: its rate is what it moved over the phase.
            m["throughput_tok_s"] = m["tokens"] / duration_s
            m["output_throughput_tok_s"] = m["output_tokens"] / duration_s
        out[name] = m
    return out


def bench_slo_mix(model: Path, cfg: MixConfig, json_path: Path | None = None, progress: bool = True) -> dict:
    """Every policy on every load; one in-process server per policy, the same requests for all."""
    from mmserve.bench.serve import InProcessServer

    tokenizer = _load_tokenizer(model)
    phases = {load: build_mix(cfg, load, cfg.seed + i, tokenizer) for i, load in enumerate(cfg.loads)}
    results: dict[str, dict[str, dict]] = {}
    for policy in cfg.policies:
        server = InProcessServer(
            model, scheduler_policy=policy, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs, interactive_ttft_ms=cfg.ttft_ms, interactive_tbt_ms=cfg.tbt_ms,
            step_time_model=cfg.step_time_model if policy == "slo" else None,
            step_time_headroom=cfg.step_time_headroom, tbt_slack_ms=cfg.tbt_slack_ms,
            batch_min_share=cfg.batch_min_share,
        )  # fmt: skip
        try:
            url = server.url.rstrip("/")
            asyncio.run(run_phase(url, [MixRequest(INTERACTIVE, "text", [{"role": "user", "content": "Warm up."}],
                                                   2, 0.0)]))  # fmt: skip
            results[policy] = {}
            for load, requests in phases.items():
                pairs, duration = asyncio.run(run_phase(url, requests))
                results[policy][f"{load:g}"] = phase_metrics(pairs, duration, cfg)
                errors = sorted({t.error for _, t in pairs if t.error})
                results[policy][f"{load:g}"]["errors"] = errors[:5]
                if progress:
                    print(
                        f"slo-mix: {policy} @ {load:g} chats/s: {_line(results[policy][f'{load:g}'])}",
                        flush=True,
                    )
        finally:
            server.close()
    report = {
        "config": {
            **{k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.__dict__.items()},
            "model": str(model),
            "workload": "slo-mix",
        },
        "phases": {f"{load:g}": _describe(reqs) for load, reqs in phases.items()},
        "results": results,
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
    return report


def _describe(requests: list[MixRequest]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for r in requests:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    return kinds


def _line(m: dict) -> str:
    i, b = m[INTERACTIVE], m[BATCH]
    attain = "n/a" if i["slo_attainment"] is None else f"{100 * i['slo_attainment']:.0f}%"
    return (
        f"chat SLO {attain}, TTFT p50/p99 {i['median_ttft_ms']:.0f}/{i['p99_ttft_ms']:.0f} ms, "
        f"TPOT p50/p99 {i['median_tpot_ms']:.0f}/{i['p99_tpot_ms']:.0f} ms; "
        f"batch {b['throughput_tok_s']:.0f} tok/s, TTFT p50 {b['median_ttft_ms']:.0f} ms"
    )


def format_slo_mix(report: dict) -> str:
    """A Markdown table: one row per (load, policy)."""
    cfg = report["config"]
    head = (
        f"slo-mix on {cfg['model']}: interactive SLO TTFT <= {cfg['ttft_ms']:g} ms and TPOT <= {cfg['tbt_ms']:g} ms; "
        f"{cfg['num_batch']} batch jobs per load, {cfg['duration_s']:g} s of chats per load\n\n"
        "| chats/s | policy | chat SLO met | chat goodput (req/s) | chat TTFT p50 / p90 / p99 (ms) | "
        "chat TPOT p50 / p99 (ms) | batch TTFT p50 (ms) | batch TPOT p50 (ms) | batch tok/s | vs fcfs |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    loads = next(iter(report["results"].values())).keys()
    for load in loads:
        fcfs = report["results"].get("fcfs", {}).get(load)
        for policy, by_load in report["results"].items():
            m = by_load[load]
            i, b = m[INTERACTIVE], m[BATCH]
            attain = (
                "n/a"
                if i["slo_attainment"] is None
                else f"{100 * i['slo_attainment']:.0f}% ({i['requests']})"
            )
            ratio = (
                f"{b['throughput_tok_s'] / fcfs[BATCH]['throughput_tok_s']:.2f}"
                if fcfs and fcfs[BATCH]["throughput_tok_s"] > 0
                else "n/a"
            )
            rows.append(
                f"| {load} | {policy} | {attain} | {i['goodput_rps']:.2f} | "
                f"{i['median_ttft_ms']:.0f} / {i['p90_ttft_ms']:.0f} / {i['p99_ttft_ms']:.0f} | "
                f"{i['median_tpot_ms']:.0f} / {i['p99_tpot_ms']:.0f} | {b['median_ttft_ms']:.0f} | "
                f"{b['median_tpot_ms']:.0f} | {b['throughput_tok_s']:.0f} | {ratio} |"
            )
    errors = [
        f"{p} @ {load}: {e}"
        for p, by in report["results"].items()
        for load, m in by.items()
        for e in m["errors"]
    ]
    if errors:
        rows.append("\nerrors: " + "; ".join(errors))
    return "\n".join(rows)
