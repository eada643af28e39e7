"""`mmserve bench serve`: online serving benchmark over the WebSocket chat or the OpenAI SSE route,
against a URL or an in-process server, with `vllm bench serve`'s arrivals and metrics. Knows the wire
formats of docs/api.md, never the engine's internals."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import math
import statistics
import time
from pathlib import Path
from typing import Any

from mmserve.bench import ServeBenchConfig, num, summary, table
from mmserve.bench.load import WARM_UP, length_forcing, run_requests, served_model
from mmserve.bench.metrics import (
    RequestTiming,
    compute_metrics,
    first_vs_repeats_ttft,
    format_metrics,
    parse_goodput,
    ratio,
    stat_list,
    throughput_figures,
    video_interference,
)
from mmserve.bench.servers import InProcessServer, ServerProcess
from mmserve.bench.workload import Request, build_requests, load_tokenizer

_ROUND_FIGURES = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "failed")
_PEER_FIGURES = ("output_throughput", "median_ttft_ms", "p99_itl_ms")  # compared with each peer's


def offline_baseline(model: Path, requests: list[Request], cfg: ServeBenchConfig) -> dict:
    """The same requests (messages, output lengths, greedy, ignore_eos) through the offline `LLM.chat`
    with the server's engine settings, in this process: the throughput the serving path is compared
    with, on exactly the same work. A warm-up request first, not counted."""
    from mmserve import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
              max_num_encoder_tokens=cfg.max_num_encoder_tokens)  # fmt: skip
    llm.chat(WARM_UP.messages, SamplingParams(max_tokens=WARM_UP.output_len, temperature=0.0))
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.chat([r.messages for r in requests], params)
    duration = time.perf_counter() - start
    return throughput_figures(len(outputs), sum(len(o.prompt_token_ids) for o in outputs),
                              sum(len(o.token_ids) for o in outputs), duration)  # fmt: skip


def bench_serve(model: Path | None, cfg: ServeBenchConfig, *, api_key: str | None = None,
                progress: bool = True) -> dict:  # fmt: skip
    """Run the workload over each transport (the options: ServeBenchConfig); `cfg.url` None starts a server
    on `model`: in this process (a thread), or with `server_process` as a child `mmserve serve` (no GIL
    shared with the clients). With several `metrics_url`s (a router's replicas; a router answers /metrics
    from one of them) the cache figures are their sum, and no engine-core loop figures are reported.

    Each round and transport draws the workload afresh (seed + round x transports + the transport's index),
    so no run finds another's prompts in the server's caches; mmserve and the peers get the same requests.
    `prefix` sends request 0 alone first (see `load.run_requests`), a cold miss whose prefix the others
    repeat; their TTFTs are reported apart (`first_vs_repeats_ttft`). `long-video`'s figures carry
    `video_interference`; `compare_no_chunk` runs everything again on a server that prefills whole and
    encodes each video in one step (as vLLM without chunked prefill; its token budget raised to the longest
    prompt), under "<transport>/no-chunk". `offline`: afterwards, draw 0 (the first transport's first round)
    through `offline_baseline`, and each key's throughputs over its own as `*_over_offline`."""
    cfg = cfg.resolved()
    goodput_slos = parse_goodput(cfg.goodput) or None
    tokenizer = load_tokenizer(model)

    @functools.cache
    def draw(index: int) -> list[Request]:  # the workload drawn with seed + index (once: the same each time)
        return build_requests(cfg, cfg.seed + index, tokenizer)

    draw(0)  # before any server starts: bad workload options fail fast
    if cfg.url is None and model is None:
        raise ValueError("give --url or --model")
    if cfg.url is not None and cfg.offline and model is None:
        raise ValueError("the offline baseline needs --model (the server's checkpoint)")
    peers: list[tuple[str, str]] = []  # --peer NAME=URL (or URL: peerN) -> (name, base URL)
    for i, spec in enumerate(cfg.peer):
        name, peer_url = spec.split("=", 1) if "=" in spec else (f"peer{i + 1}", spec)
        if not name or "/" in name or not peer_url.startswith(("http://", "https://")):
            raise ValueError(f"--peer: expected NAME=URL or URL (http:// or https://), got {spec!r}")
        peers.append((name, peer_url.rstrip("/")))
    # Peers speak the OpenAI HTTP API only: with peers, mmserve runs HTTP too, on the same requests. A target:
    # (its figures' key, "{}" the transport: "{}", "{}/no-chunk" or "NAME/{}"; `run_requests`' options for it).
    transports = cfg.transports + (("http",) if peers and "http" not in cfg.transports else ())
    # A peer's output lengths are forced the way it takes (transformers serve refuses vLLM's ignore_eos).
    peer_targets: list[tuple[str, dict[str, Any]]] = [
        (f"{name}/{{}}", {"url": url, "model": (served := served_model(url)), "length_forcing": length_forcing(url, served)})
        for name, url in peers
    ]
    engine_kwargs: dict[str, Any] = {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                                     "max_num_encoder_tokens": cfg.max_num_encoder_tokens}  # fmt: skip
    metrics_urls = list(cfg.metrics_url) or None
    rounds: dict[str, list[dict]] = {}  # key -> its figures in each round
    raw: dict[str, list[dict]] = {}  # key -> each request's timing, every round's
    longest_prompt = 0
    for system in ("mmserve", "no-chunk") if cfg.compare_no_chunk else ("mmserve",):
        if system == "no-chunk":  # whole prefills need a budget that holds the longest prompt
            engine_kwargs |= {"scheduler_policy": "no_chunk", "chunk_encoder": False,
                              "max_num_batched_tokens": max(cfg.max_num_batched_tokens, longest_prompt)}  # fmt: skip
        with contextlib.ExitStack() as stack:  # the server we start, closed on leaving
            url = str(cfg.url).rstrip("/")
            if cfg.url is None:
                assert model is not None
                url = stack.enter_context(contextlib.closing(
                    ServerProcess(model, **engine_kwargs, api_server_count=cfg.api_server_count,
                                  no_engine_process=not cfg.engine_process)
                    if cfg.server_process else InProcessServer(model, **engine_kwargs))).url  # fmt: skip
            loop_url = url if not metrics_urls else metrics_urls[0] if len(metrics_urls) == 1 else None
            ours: tuple[str, dict[str, Any]] = ("{}" if system == "mmserve" else "{}/no-chunk", {
                "url": url, "api_key": api_key, "metrics_urls": metrics_urls, "loop_url": loop_url})  # fmt: skip
            for round_index, (index, transport) in itertools.product(range(cfg.repeats), enumerate(transports)):
                requests = draw(round_index * len(transports) + index)
                for key_format, server in [ours, *peer_targets] if transport == "http" else [ours]:
                    timings, figures = _run(server, transport, requests, cfg, goodput_slos, progress)
                    longest_prompt = max([longest_prompt, *(t.prompt_tokens for t in timings)])
                    key = key_format.format(transport)
                    rounds.setdefault(key, []).append(figures)
                    raw.setdefault(key, []).extend({
                        "round": round_index, "ttft_s": t.ttft_s, "tpot_s": t.tpot_s, "e2el_s": t.e2el_s,
                        "itls_s": t.itls_s, "output_tokens": t.output_tokens, "success": t.success}
                        for t in timings)  # fmt: skip
    # Each key's figures: its round of median output throughput (the lower middle of an even count), with every
    # round's headline figures under "rounds" when there were several.
    results: dict[str, dict] = {}
    for key, figures in rounds.items():
        results[key] = dict(sorted(figures, key=lambda r: r["output_throughput"])[(len(figures) - 1) // 2])
        if len(figures) > 1:
            results[key]["rounds"] = [{k: r.get(k) for k in _ROUND_FIGURES} for r in figures]
    offline = None
    if cfg.offline:
        assert model is not None
        offline = offline_baseline(model, draw(0), cfg)
        for m in results.values():
            m |= {f"{k}_over_offline": m[k] / offline[k] for k in ("output_throughput", "total_token_throughput")}
    config = {
        **dataclasses.asdict(cfg),
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,  # JSON has no inf
        "model": str(model) if model else None,
        "in_process_server": cfg.url is None and not cfg.server_process,
        "first_request_alone": cfg.workload == "prefix",
        "peer_length_forcing": {key.split("/")[0]: server["length_forcing"] for key, server in peer_targets},
        # the no-chunk server's token budget: the longest prompt seen on the chunked one
        "no_chunk_max_num_batched_tokens": engine_kwargs["max_num_batched_tokens"] if cfg.compare_no_chunk else None,
    }
    chunk_vs_no_chunk = _chunk_comparison(results, cfg.transports[0]) if cfg.compare_no_chunk else None
    peer_ratios = {name: _peer_comparison(rounds["http"], rounds[f"{name}/http"], raw["http"], raw[f"{name}/http"])
                   for name, _ in peers}  # fmt: skip
    return {"config": config, "results": results, "offline": offline, "chunk_vs_no_chunk": chunk_vs_no_chunk,
            "peers": peer_ratios or None, "requests": raw}  # fmt: skip


def _run(server: dict[str, Any], transport: str, requests: list[Request], cfg: ServeBenchConfig,
         goodput_slos: dict[str, float] | None, progress: bool) -> tuple[list[RequestTiming], dict]:
    """One timed run of `requests` over `transport` on the server `server` names (`run_requests`' url, api_key,
    model, metrics_urls, loop_url): the timings and their figures (vLLM's metrics, the workload's own, the
    server's cache hit rates and engine-core loop where it reports them, errors)."""
    timings, duration, server_figures = asyncio.run(run_requests(
        requests=requests, transport=transport, request_rate=cfg.request_rate, burstiness=cfg.burstiness,
        max_concurrency=cfg.max_concurrency, seed=cfg.seed, progress=progress, media_source=cfg.media_source,
        first_alone=cfg.workload == "prefix", video_interval_s=cfg.video_interval_s, **server))  # fmt: skip
    figures = compute_metrics(timings, duration, goodput_slos)
    if cfg.workload == "prefix":
        figures |= first_vs_repeats_ttft(timings)
    if cfg.workload == "long-video":
        texts = sum(not r.late for r in requests)  # the videos are late, after every text
        figures |= video_interference(timings[:texts], timings[texts:])
    figures |= {**server_figures, "errors": sorted({t.error for t in timings if t.error})[:10]}
    return timings, figures


def _peer_comparison(ours: list[dict], theirs: list[dict], ours_raw: list[dict], theirs_raw: list[dict]) -> dict:
    """mmserve's figures over a peer's, round by round (the same requests in each round) and their
    medians: above 1 means mmserve moved more tokens / took longer. `*_raw`: each request's timing, every
    round's, in the same order on both."""
    out: dict[str, Any] = {}
    for name in _PEER_FIGURES:
        per_round = [a[name] / b[name] for a, b in zip(ours, theirs, strict=True) if a.get(name) and b.get(name)]
        out[f"{name}_mmserve_over_peer"] = statistics.median(per_round) if per_round else None
        out[f"{name}_mmserve_over_peer_rounds"] = per_round
    # Forced lengths: every request's output token count equal, or the throughputs compare different work.
    out["output_tokens_equal"] = [r["output_tokens"] for r in ours_raw] == [r["output_tokens"] for r in theirs_raw]
    return out


def _chunk_comparison(results: dict[str, dict], transport: str) -> dict:
    """long-video, chunked against no-chunk on `transport` (both keys are in `results`): text ITL p99 and max
    while the videos were in, and output throughput (above 1: chunking costs throughput)."""
    chunk, whole = results[transport], results[f"{transport}/no-chunk"]
    itl = {f"{q}_text_itl_in_window_chunk_over_no_chunk": f"text_itl_in_window_{q}_ms" for q in ("p99", "max")}
    throughput = ratio(whole["output_throughput"], chunk["output_throughput"])
    return {"transport": transport, **{name: ratio(chunk.get(k), whole.get(k)) for name, k in itl.items()},
            "output_throughput_no_chunk_over_chunk": throughput}  # fmt: skip


def format_report(report: dict) -> str:
    """Each key's vLLM summary with the workload's own figures, then the comparisons (no-chunk, peers, offline)."""
    parts = []
    for key, m in report["results"].items():
        rows: list[tuple[str, str]] = []
        if "ttft_first_ms" in m:  # prefix: request 0 (cold) against the repeats
            rows += [("TTFT of the first request (ms):", num(m["ttft_first_ms"])),
                     ("TTFT of repeats (ms):", stat_list(m, "ttft_repeats_{}_ms", ("median", "p90"))),
                     ("TTFT repeats median / first:", num(m["ttft_repeats_over_first"], ".3f"))]  # fmt: skip
        for cache, title in (("prefix_cache", "Prefix cache"), ("mm_cache", "Encoder cache")):
            if (hit_rate := m.get(f"server_{cache}_hit_rate")) is not None:
                tokens = f"({m[f'server_{cache}_hits']:.0f} of {m[f'server_{cache}_queries']:.0f} tokens)"
                rows.append((f"{title} hits (server):", f"{hit_rate:.1%} {tokens}"))
        if m.get("video_window_s") is not None:  # long-video: text ITL while the videos were in, and outside
            itl = ("p50", "p99", "max")
            rows += [("Videos in the server (s):", num(m["video_window_s"], ".2f")),
                     ("Text ITL while videos are in (ms):", stat_list(m, "text_itl_in_window_{}_ms", itl)),
                     ("Text ITL otherwise (ms):", stat_list(m, "text_itl_out_window_{}_ms", itl)),
                     ("Video TTFT (ms):", stat_list(m, "video_ttft_{}_ms", ("median", "max")))]  # fmt: skip
        if "output_throughput_over_offline" in m:
            over = [num(m[f"{k}_throughput_over_offline"], ".3f") for k in ("output", "total_token")]
            rows.append(("Output / total tok/s over offline:", " / ".join(over)))
        if loop := m.get("engine_core_loop"):
            shares = " / ".join(num(loop[f"{k}_share"], ".3f") for k in ("step", "io", "idle"))
            per_step = (f"{num(loop['io_us_per_step'])} / {num(loop['bytes_out_per_step'], '.0f')} "
                        f"(io / step time {num(loop['io_over_step_time'], '.4f')})")  # fmt: skip
            rows += [("Engine-core loop: step / io / idle:", shares), ("Boundary per step: us / bytes out:", per_step)]
        parts.append(f"== {key} ==\n{format_metrics(m, rows)}")
        if m.get("errors"):
            parts.append("errors: " + "; ".join(m["errors"]))
    if c := report.get("chunk_vs_no_chunk"):
        rows = [(f"{q} text ITL while videos are in:", num(c[f"{q}_text_itl_in_window_chunk_over_no_chunk"], ".3f"))
                for q in ("p99", "max")]  # fmt: skip
        rows.append(("output tok/s, no-chunk / chunked:", num(c["output_throughput_no_chunk_over_chunk"], ".3f")))
        parts.append(f"== chunked / no-chunk ({c['transport']}) ==\n" + summary(rows))
    if peers := report.get("peers"):
        rows = [(name, len(r["output_throughput_mmserve_over_peer_rounds"]),
                 *(num(r[f"{k}_mmserve_over_peer"], ".3f") for k in _PEER_FIGURES),
                 "yes" if r["output_tokens_equal"] else "NO") for name, r in peers.items()]
        parts.append("== mmserve / peer (HTTP, the same requests; median of the rounds) ==\n"
                     + table(("peer", "rounds", "output tok/s", "median TTFT", "p99 ITL", "same tokens"), rows))  # fmt: skip
    if offline := report.get("offline"):
        parts.append("== offline LLM.chat, same requests ==\n" + summary([
            ("Duration (s):", num(offline["duration_s"], ".2f")),
            ("Output token throughput (tok/s):", num(offline["output_throughput"], ".2f")),
            ("Total token throughput (tok/s):", num(offline["total_token_throughput"], ".2f"))]))  # fmt: skip
    return "\n".join(parts)
