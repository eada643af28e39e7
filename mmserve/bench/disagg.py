"""`mmserve bench disagg`: chats streaming while long image or video prompts arrive, served by one colocated
`mmserve serve` and by a prefill and a decode instance (NIXL) behind vllm-router's PD mode, on the same requests:
the chats' TTFT and ITL, the long prompts' TTFT, tok/s, and what the decode instance's KV reads cost."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from mmserve.bench import DisaggBenchConfig, num, table
from mmserve.bench.load import run_requests
from mmserve.bench.metrics import compute_metrics, percentile_ms, ratio, video_interference
from mmserve.bench.router import SERVED_MODEL_NAME, PDRouterProcess, pd_instance
from mmserve.bench.servers import ServerProcess
from mmserve.bench.workload import Request, load_tokenizer, media_parts, random_text, user

SYSTEMS = ("colocated", "disagg")
UCX_TCP = {"UCX_TLS": "tcp,self"}  # UCX's TCP transport, as between machines
# (label, key) of each system's figures, as the table shows them
_FIGURES = (("chat TTFT p50 ms", "chat_ttft_p50_ms"), ("chat TTFT p99 ms", "chat_ttft_p99_ms"),
            ("chat ITL p50 ms", "chat_itl_p50_ms"), ("chat ITL p99 ms", "chat_itl_p99_ms"),
            ("chat ITL p99 ms, long prompts in", "chat_itl_p99_long_in_ms"),
            ("long TTFT p50 ms", "long_ttft_p50_ms"), ("long TTFT max ms", "long_ttft_max_ms"),
            ("output tok/s", "output_throughput"), ("failed", "failed"))  # fmt: skip


def build_requests(cfg: DisaggBenchConfig, seed: int, tokenizer: Any) -> list[Request]:
    """`num_chats` text chats, then `num_long` long prompts (fresh random media each), marked `late`: sent once
    every chat streams, `long_interval_s` apart (load.run_requests)."""
    rng, np_rng, image = random.Random(seed), np.random.default_rng(seed), cfg.long_media == "image"
    chats = [Request(user(random_text(rng, cfg.chat_input_len, tokenizer)), cfg.chat_output_len)
             for _ in range(cfg.num_chats)]  # fmt: skip
    longs = [Request(user(f"Describe the {cfg.long_media}. " + random_text(rng, 8, tokenizer),
                          media_parts(np_rng, cfg.num_images if image else 0, cfg.image_size,
                                      0 if image else cfg.num_frames, cfg.video_size)),
                     cfg.long_output_len, kind=cfg.long_media, late=True) for _ in range(cfg.num_long)]  # fmt: skip
    return chats + longs


def scrape(url: str) -> dict[str, float]:
    """An instance's KV transfer figures from its /metrics: reads by outcome, blocks read, read seconds, leases,
    and its KV block's bytes (bytes per token x block size)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).raise_for_status().text
    out: dict[str, float] = {}
    for s in (s for family in text_string_to_metric_families(text) for s in family.samples):
        name = s.name.removeprefix("mmserve:")
        if name == "kv_transfer_loads_total":
            out[f"reads_{s.labels['outcome']}"] = out.get(f"reads_{s.labels['outcome']}", 0.0) + s.value
        elif name in ("kv_transfer_blocks_read_total", "kv_transfer_read_seconds_total", "kv_transfer_leases",
                      "kv_cache_bytes_per_token"):  # fmt: skip
            out[name] = s.value
        elif name == "engine_config_info":
            out["block_size"] = float(s.labels["block_size"])
    return out


def transfer_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """What the decode instance read between two scrapes: reads done / failed, blocks, ms per block, MB/s (the
    read seconds are each read's wall time, from posting it to its end)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("reads_done", "reads_failed",
         "kv_transfer_blocks_read_total", "kv_transfer_read_seconds_total")}  # fmt: skip
    blocks, seconds = d["kv_transfer_blocks_read_total"], d["kv_transfer_read_seconds_total"]
    block_bytes = after.get("kv_cache_bytes_per_token", 0.0) * after.get("block_size", 0.0)
    return {"reads_done": d["reads_done"], "reads_failed": d["reads_failed"], "blocks_read": blocks,
            "kv_block_bytes": block_bytes, "read_ms_per_block": ratio(1e3 * seconds, blocks),
            "read_mb_per_s": ratio(blocks * block_bytes / 1e6, seconds)}  # fmt: skip


async def greedy_texts(url: str, requests: list[Request]) -> list[str | None]:
    """Each request's text, not streamed, all at once (None: it failed)."""
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(req: Request) -> str | None:
            r = await client.post(url + "/v1/chat/completions", json={"model": SERVED_MODEL_NAME, **req.body()})
            return r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None

        return list(await asyncio.gather(*map(one, requests)))


def run_system(url: str, requests: list[Request], cfg: DisaggBenchConfig, decode_url: str | None) -> dict:
    """One timed run over streamed HTTP (no warm-up: the agreement pass warmed every instance up); with
    `decode_url`, the decode instance's reads over the span too."""
    before = scrape(decode_url) if decode_url else {}
    timings, duration, _ = asyncio.run(run_requests(url, requests, "http", video_interval_s=cfg.long_interval_s,
                                                    warm_up=False, progress=False, model=SERVED_MODEL_NAME))
    chats, longs = timings[: cfg.num_chats], timings[cfg.num_chats :]
    c, ttfts = compute_metrics(chats, duration), [t.ttft_s for t in longs if t.ttft_s is not None]
    return {"chat_ttft_p50_ms": c["median_ttft_ms"], "chat_ttft_p99_ms": c["p99_ttft_ms"],
            "chat_itl_p50_ms": c["median_itl_ms"], "chat_itl_p99_ms": c["p99_itl_ms"],
            "chat_itl_p99_long_in_ms": video_interference(chats, longs)["text_itl_in_window_p99_ms"],
            "long_ttft_p50_ms": percentile_ms(ttfts, 50.0), "long_ttft_max_ms": percentile_ms(ttfts, 100.0),
            **{k: compute_metrics(timings, duration)[k] for k in ("output_throughput", "failed", "duration_s")},
            **(transfer_figures(before, scrape(decode_url)) if decode_url else {}),
            "errors": sorted({t.error for t in timings if t.error})[:5]}  # fmt: skip


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def threads_per_instance() -> int:
    """Torch threads of the prefill and of the decode instance: half of this machine's cores each."""
    return max(1, (os.cpu_count() or 2) // 2)


def bench_disagg(model: Path, cfg: DisaggBenchConfig) -> dict:
    """A colocated instance, a prefill and a decode instance (and the router over them), all started at once
    and up throughout. First an untimed greedy pass of one draw through both systems (it warms them up), then
    `rounds` rounds, each a fresh draw run by both systems in turn (the first alternating); medians reported."""
    tokenizer = load_tokenizer(model)
    args = ("--num-kv-blocks", str(cfg.num_kv_blocks), "--decode-workers", "1")
    with contextlib.ExitStack() as stack:
        # The colocated engine computes on every core; the prefill and the decode instance on half each, as two
        # machines' worth of compute would be split (each with all of them, their torch threads would
        # oversubscribe the cores and spin against each other).
        half = {**UCX_TCP, "OMP_NUM_THREADS": str(threads_per_instance())}
        starts = (lambda: ServerProcess(model, served_model_name=SERVED_MODEL_NAME, extra_args=args, wait=False,
                                        env=UCX_TCP),
                  lambda: pd_instance(model, "kv_producer", args, False, half),
                  lambda: pd_instance(model, "kv_consumer", args, False, half))  # fmt: skip
        colocated, prefill, decode = (stack.enter_context(contextlib.closing(start())) for start in starts)
        for server in (colocated, prefill, decode):
            server.wait_until_up()
        router = stack.enter_context(contextlib.closing(PDRouterProcess([prefill.url], [decode.url])))
        urls = {"colocated": colocated.url, "disagg": router.url}
        check = build_requests(cfg, cfg.seed * 1000 + cfg.rounds, tokenizer)  # a draw no round gets
        texts = {name: asyncio.run(greedy_texts(url, check)) for name, url in urls.items()}
        rounds: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
        for r in range(cfg.rounds):
            requests = build_requests(cfg, cfg.seed * 1000 + r, tokenizer)
            for name in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
                rounds[name].append(run_system(urls[name], requests, cfg, decode.url if name == "disagg" else None))
        leases_left = scrape(prefill.url).get("kv_transfer_leases")
    a, b = texts["colocated"], texts["disagg"]
    agreement = sum(x is not None and x == y for x, y in zip(a, b, strict=True)) / len(check)
    results = {name: {k: _median([r[k] for r in rs]) for k in rs[0] if k != "errors"}
               | {"errors": sorted({e for r in rs for e in r["errors"]})} for name, rs in rounds.items()}  # fmt: skip
    over = {k: ratio(results["disagg"][k], results["colocated"][k]) for _, k in _FIGURES}
    return {"config": {"model": str(model), **asdict(cfg)}, "cpu_count": os.cpu_count(),
            "threads_per_pd_instance": threads_per_instance(), "results": results,
            "disagg_over_colocated": over, "greedy_agreement": agreement,
            "greedy_failed": sum(x is None for x in (*a, *b)), "prefill_leases_after": leases_left,
            "rounds": rounds}  # fmt: skip


def format_report(report: dict) -> str:
    res, over = report["results"], report["disagg_over_colocated"]
    rows = [(label, *(num(res[s][k], ".0f" if k == "failed" else ".1f") for s in SYSTEMS), num(over[k], ".2f"))
            for label, k in _FIGURES]  # fmt: skip
    d = res["disagg"]
    reads = (f"KV reads (decode instance, median round): {num(d['reads_done'], '.0f')} done, "
             f"{num(d['reads_failed'], '.0f')} failed, {num(d['blocks_read'], '.0f')} blocks of "
             f"{num(d['kv_block_bytes'] / 1024, '.0f')} KiB, {num(d['read_ms_per_block'], '.2f')} ms per block, "
             f"{num(d['read_mb_per_s'], '.0f')} MB/s")  # fmt: skip
    errors = [f"{s} errors: " + "; ".join(res[s]["errors"]) for s in SYSTEMS if res[s]["errors"]]
    return "\n".join([
        table(("figure (median of rounds)", *SYSTEMS, "disagg/colocated"), rows), reads,
        f"greedy agreement, disagg vs colocated: {report['greedy_agreement']:.3f} of the requests' texts identical",
        *errors,
        f"All three instances share this machine's {report['cpu_count']} cores (the colocated engine computes on "
        f"all, the prefill and decode instances on {report['threads_per_pd_instance']} thread(s) each): splitting "
        "prefill from decode buys no compute here, so these figures show the protocol's overhead (the router's hop, "
        "the prefill request, the NIXL read over UCX TCP) and the read cost per block, not the GPU-scale benefit "
        "(decode steps that never wait behind a long prefill on a device of their own)."])  # fmt: skip
