"""`mmserve bench serve`: online serving benchmark over the WebSocket chat or the OpenAI SSE route,
against a URL or an in-process server, with `vllm bench serve`'s arrivals and metrics. Knows the wire
formats of docs/api.md, never the engine's internals."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

from mmserve.bench import ServeBenchConfig
from mmserve.bench.load import run_requests, served_model
from mmserve.bench.metrics import (
    RequestTiming,
    compute_metrics,
    first_vs_repeats_ttft,
    parse_goodput,
    throughput_figures,
    video_interference,
)
from mmserve.bench.servers import InProcessServer, ServerProcess
from mmserve.bench.workload import Request, build_requests, load_tokenizer


def offline_baseline(model: Path, requests: list[Request], cfg: ServeBenchConfig) -> dict:
    """The same requests (messages, output lengths, greedy, ignore_eos) through the offline `LLM.chat`
    with the server's engine settings, in this process: the throughput the serving path is compared
    with, on exactly the same work. A warm-up request first, not counted."""
    from mmserve import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
              max_num_encoder_tokens=cfg.max_num_encoder_tokens)  # fmt: skip
    llm.chat([{"role": "user", "content": "Warm up."}], SamplingParams(max_tokens=2, temperature=0.0))
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.chat([r.messages for r in requests], params)
    duration = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    return throughput_figures(len(outputs), prompt_tokens, output_tokens, duration)


def bench_serve(
    model: Path | None,
    cfg: ServeBenchConfig,
    *,
    api_key: str | None = None,
    progress: bool = True,
) -> dict:
    """Run the workload over each transport; `cfg.url` None starts a server on `model`: in this process
    (a thread), or with `server_process` as a child `mmserve serve` (no GIL shared with the clients).

    `metrics_url`: the servers whose /metrics give the cache figures, summed (with `url` a router: every
    replica behind it; a router answers /metrics from one replica); the engine-core loop figures are then
    reported only for a single one.

    `offline`: afterwards, the first transport's requests also run through the offline `LLM.chat` in this
    process, with `max_num_seqs` and `max_num_batched_tokens` (give the server's when it is at `url`), and
    each transport's throughputs are reported over the offline ones (`*_over_offline`).

    `long-video`: each transport's figures also carry `video_interference` (text ITL while the videos
    are in, against the rest). `compare_no_chunk` (servers it starts only) runs everything again on a
    server that prefills whole and encodes each video in one step, as vLLM without chunked prefill
    (token budget raised to the longest prompt), under the key "<transport>/no-chunk".

    Each transport gets its own draw of the workload (seed + its index): the same distribution, but
    no prompt, image or shared prefix of one transport is in the server's caches for the next. In
    `prefix`, request 0 is sent alone before the rest (see `load.run_requests`), so every transport's
    request 0 is a cold miss and the others repeat its prefix; their TTFTs are reported apart
    (`first_vs_repeats_ttft`)."""
    cfg = cfg.resolved()
    goodput_slos = parse_goodput(list(cfg.goodput)) or None
    tokenizer = load_tokenizer(model)
    metrics_urls = list(cfg.metrics_url) or None

    def requests_for(index: int) -> list[Request]:
        return build_requests(cfg, cfg.seed + index, tokenizer)

    requests = requests_for(0)  # built before any server starts: bad workload options fail fast
    if cfg.url is None and model is None:
        raise ValueError("give --url or --model")
    if cfg.url is not None and cfg.offline and model is None:
        raise ValueError("the offline baseline needs --model (the server's checkpoint)")
    engine_kwargs: dict[str, Any] = {
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_num_encoder_tokens": cfg.max_num_encoder_tokens,
    }
    peers = [_peer(i, spec) for i, spec in enumerate(cfg.peer)]
    # Peers speak the OpenAI HTTP API only: with peers, mmserve runs HTTP too, on the same requests.
    transports = cfg.transports + (("http",) if peers and "http" not in cfg.transports else ())
    draws: dict[int, list[Request]] = {0: requests}
    rounds: dict[str, list[dict]] = {}  # key -> its figures in each round
    raw: dict[str, list[dict]] = {}
    longest_prompt = 0
    for system in ("mmserve", "no-chunk") if cfg.compare_no_chunk else ("mmserve",):
        server: InProcessServer | ServerProcess | None = None
        if cfg.url is None:
            assert model is not None
            if system == "no-chunk":  # whole prefills need a budget that holds the longest prompt
                engine_kwargs |= {"scheduler_policy": "no_chunk", "chunk_encoder": False}
                engine_kwargs["max_num_batched_tokens"] = max(cfg.max_num_batched_tokens, longest_prompt)
            server = (
                ServerProcess(model, **engine_kwargs, api_server_count=cfg.api_server_count,
                              no_engine_process=not cfg.engine_process)
                if cfg.server_process
                else InProcessServer(model, **engine_kwargs)
            )  # fmt: skip
        base_url = (server.url if server is not None else str(cfg.url)).rstrip("/")
        loop_url = base_url if not metrics_urls else metrics_urls[0] if len(metrics_urls) == 1 else None
        # (key prefix, url, engine-core loop URL, /metrics URLs, API key, transports)
        targets = [("" if system == "mmserve" else f"/{system}", base_url, loop_url, metrics_urls, api_key, transports)]
        targets += [(f"{name}/", url, None, [url], None, ("http",)) for name, url in peers]
        names = {f"{name}/": served_model(url) for name, url in peers}  # what each peer must be asked for
        try:
            for round_index in range(cfg.repeats):
                for index, transport in enumerate(transports):
                    # A fresh draw each round (no prompt of an earlier round is cached anywhere), and in
                    # `prefix` each transport its own (its request 0 is a cold miss).
                    draw = round_index * len(transports) + (index if cfg.workload == "prefix" else 0)
                    requests = draws.setdefault(draw, requests_for(draw))
                    for prefix, url, loop, scraped, key_for_api, speaks in targets:
                        if transport not in speaks:
                            continue
                        loop_before = _core_loop(loop, key_for_api) if loop is not None else None
                        run = run_requests(
                            url, requests, transport, cfg.request_rate, cfg.burstiness, cfg.max_concurrency,
                            key_for_api, cfg.seed, progress, media_source=cfg.media_source,
                            first_alone=cfg.workload == "prefix", video_interval_s=cfg.video_interval_s,
                            metrics_urls=scraped, model=names.get(prefix, "bench"),
                        )  # fmt: skip
                        timings, duration, cache = asyncio.run(run)
                        longest_prompt = max([longest_prompt, *(t.prompt_tokens for t in timings)])
                        key = f"{prefix}{transport}" if prefix.endswith("/") else f"{transport}{prefix}"
                        figures = _figures(cfg.workload, timings, duration, cache, goodput_slos, requests)
                        loop_after = _core_loop(loop, key_for_api) if loop is not None else None
                        if loop_after is not None:  # before the first step the server reports no loop times yet
                            figures["engine_core_loop"] = _loop_figures(loop_before, loop_after, duration)
                        rounds.setdefault(key, []).append(figures)
                        raw.setdefault(key, []).extend(
                            {"round": round_index, "ttft_s": t.ttft_s, "tpot_s": t.tpot_s, "e2el_s": t.e2el_s,
                             "itls_s": t.itls_s, "output_tokens": t.output_tokens, "success": t.success}
                            for t in timings
                        )  # fmt: skip
        finally:
            if server is not None:
                server.close()
    results = {key: _median_round(figures) for key, figures in rounds.items()}
    offline_figures = None
    if cfg.offline:
        assert model is not None
        offline_figures = offline_baseline(model, requests_for(0), cfg)
        for metrics in results.values():
            for key in ("output_throughput", "total_token_throughput"):
                metrics[f"{key}_over_offline"] = metrics[key] / offline_figures[key]
    report = {
        "config": {
            **dataclasses.asdict(cfg),
            "model": str(model) if model else None,
            "in_process_server": cfg.url is None and not cfg.server_process,
            "first_request_alone": cfg.workload == "prefix",
            # the no-chunk server's token budget: the longest prompt seen on the chunked one
            "no_chunk_max_num_batched_tokens": engine_kwargs["max_num_batched_tokens"] if cfg.compare_no_chunk else None,
        },
        "results": results,
        "offline": offline_figures,
        "chunk_vs_no_chunk": _chunk_comparison(results, cfg.transports[0]) if cfg.compare_no_chunk else None,
        "peers": {name: _peer_comparison(rounds["http"], rounds[f"{name}/http"]) for name, _ in peers} or None,
        "requests": raw,
    }
    report["config"]["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate  # JSON has no inf
    return report


def _peer(index: int, spec: str) -> tuple[str, str]:
    """--peer NAME=URL (or URL: peerN) -> (name, base URL)."""
    name, sep, url = spec.partition("=")
    if not sep:
        name, url = f"peer{index + 1}", spec
    if not name or "/" in name or not url.startswith(("http://", "https://")):
        raise ValueError(f"--peer: expected NAME=URL or URL (http:// or https://), got {spec!r}")
    return name, url.rstrip("/")


def _median_round(rounds: list[dict]) -> dict:
    """One key's figures over the rounds: the round of median output throughput (the lower middle of an even
    count), with every round's headline figures under `rounds` when there were several."""
    ranked = sorted(range(len(rounds)), key=lambda i: rounds[i]["output_throughput"])
    figures = dict(rounds[ranked[(len(rounds) - 1) // 2]])
    if len(rounds) > 1:
        figures["rounds"] = [{k: r.get(k) for k in _ROUND_FIGURES} for r in rounds]
    return figures


_ROUND_FIGURES = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "failed")


def _peer_comparison(ours: list[dict], theirs: list[dict]) -> dict:
    """mmserve's figures over a peer's, round by round (the same requests in each round) and their medians:
    above 1 means mmserve moved more tokens / took longer."""
    import statistics

    def ratios(name: str) -> list[float]:
        return [a[name] / b[name] for a, b in zip(ours, theirs, strict=True) if a.get(name) and b.get(name)]

    out: dict[str, Any] = {}
    for name in ("output_throughput", "median_ttft_ms", "p99_itl_ms"):
        per_round = ratios(name)
        out[f"{name}_mmserve_over_peer"] = statistics.median(per_round) if per_round else None
        out[f"{name}_mmserve_over_peer_rounds"] = per_round
    return out


def _figures(
    workload: str,
    timings: list[RequestTiming],
    duration: float,
    cache: dict,
    goodput_slos: dict[str, float] | None,
    requests: list[Request],
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
    for transport, m in report["results"].items():
        rows: list[tuple[str, str]] = []
        if "ttft_first_ms" in m:  # prefix: request 0 (cold) against the repeats
            rows += [("TTFT of the first request (ms):", _num(m["ttft_first_ms"])),
                     ("TTFT of repeats (ms):", f"median {_num(m['ttft_repeats_median_ms'])}, "
                                               f"p90 {_num(m['ttft_repeats_p90_ms'])}"),
                     ("TTFT repeats median / first:", _num(m["ttft_repeats_over_first"], 3))]  # fmt: skip
        for cache, title in (("prefix_cache", "Prefix cache"), ("mm_cache", "Encoder cache")):
            if m.get(f"server_{cache}_hit_rate") is not None:
                rows.append((f"{title} hits (server):", f"{m[f'server_{cache}_hit_rate']:.1%} "
                             f"({m[f'server_{cache}_hits']:.0f} of {m[f'server_{cache}_queries']:.0f} tokens)"))  # fmt: skip
        if m.get("video_window_s") is not None:  # long-video: text ITL while the videos were in, and outside
            rows.append(("Videos in the server (s):", _num(m["video_window_s"], 2)))
            for where, title in (("in", "while videos are in"), ("out", "otherwise")):
                rows.append((f"Text ITL {title} (ms):", ", ".join(
                    f"{q} {_num(m[f'text_itl_{where}_window_{q}_ms'])}" for q in ("p50", "p99", "max"))))  # fmt: skip
            rows.append(("Video TTFT (ms):", f"median {_num(m['video_ttft_median_ms'])}, "
                                             f"max {_num(m['video_ttft_max_ms'])}"))  # fmt: skip
        if "output_throughput_over_offline" in m:
            rows.append(("Output / total tok/s over offline:", f"{m['output_throughput_over_offline']:.3f} / "
                                                                f"{m['total_token_throughput_over_offline']:.3f}"))  # fmt: skip
        if loop := m.get("engine_core_loop"):
            rows += [("Engine-core loop: step / io / idle:", " / ".join(
                         _num(loop[f"{k}_share"], 3) for k in ("step", "io", "idle"))),
                     ("Boundary per step: us / bytes out:", f"{_num(loop['io_us_per_step'], 1)} / "
                      f"{_num(loop['bytes_out_per_step'], 0)} (io / step time {_num(loop['io_over_step_time'], 4)})")]  # fmt: skip
        parts += [f"== {transport} ==\n{format_metrics(m)}", *([_rows(rows)] if rows else [])]
        if m.get("errors"):
            parts.append("errors: " + "; ".join(m["errors"]))
    if comparison := report.get("chunk_vs_no_chunk"):
        parts.append(f"== chunked / no-chunk ({comparison['transport']}) ==\n" + _rows([
            ("p99 text ITL while videos are in:", _num(comparison["p99_text_itl_in_window_chunk_over_no_chunk"], 3)),
            ("max text ITL while videos are in:", _num(comparison["max_text_itl_in_window_chunk_over_no_chunk"], 3)),
            ("output tok/s, no-chunk / chunked:", _num(comparison["output_throughput_no_chunk_over_chunk"], 3))]))  # fmt: skip
    for name, r in (report.get("peers") or {}).items():
        rounds = len(r["output_throughput_mmserve_over_peer_rounds"])
        parts.append(f"== mmserve / {name} (HTTP, same requests, median of {rounds} round(s)) ==\n" + _rows([
            (f"{title}:", _num(r[f"{key}_mmserve_over_peer"], 3))
            for key, title in (("output_throughput", "output tok/s"), ("median_ttft_ms", "median TTFT"),
                               ("p99_itl_ms", "p99 ITL"))]))  # fmt: skip
    if offline := report.get("offline"):
        parts.append("== offline LLM.chat, same requests ==\n" + _rows([
            ("Duration (s):", f"{offline['duration_s']:.2f}"),
            ("Output token throughput (tok/s):", f"{offline['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{offline['total_token_throughput']:.2f}")]))  # fmt: skip
    return "\n".join(parts)


def _rows(rows: list[tuple[str, str]]) -> str:
    """vLLM's summary layout: each label in 40 columns, its value right-aligned in the next 12 (or longer)."""
    return "\n".join(f"{label:<40}{value:>12}" for label, value in rows)


def _num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"
