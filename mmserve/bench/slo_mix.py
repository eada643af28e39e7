"""`mmserve bench serve --workload slo-mix`: interactive chats (short text, single images) arriving as a
Poisson process over a backlog of batch jobs (long prompts, multi-image, long videos), at several chat
loads, under the `fcfs`, `priority` and `slo` policies in the same run (one in-process server per policy
on the same model, the same requests at the same offsets). Reports per class TTFT / TPOT percentiles,
interactive SLO attainment, goodput and batch throughput. Speaks the HTTP API only (service_tier
"flex" and priority 1 mark batch work), never the engine's internals.

With a `SweepConfig` (`--sweep`) the chat rate rises geometrically until every policy's attainment is below
the bar, and each policy's capacity (the rate at 90% attainment, as Sarathi-Serve and DistServe state it)
is reported. Targets and the first rate not given are derived from a short measurement of the machine at
start (`calibrate`), so the same command stresses a slow and a fast CPU alike."""

from __future__ import annotations

import asyncio
import math
import statistics
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mmserve.bench import MixConfig, SweepConfig
from mmserve.bench.load import run_requests
from mmserve.bench.metrics import PERCENTILES, RequestTiming, meets_slos, summarize_ms
from mmserve.bench.servers import InProcessServer
from mmserve.bench.workload import BATCH, INTERACTIVE, Request, build_chats, build_mix, load_tokenizer

QUICK_MIX = MixConfig().quick()  # what --quick runs


def run_phase(url: str, requests: list[Request]) -> tuple[list[tuple[Request, RequestTiming]], float]:
    """Each request at its offset over streamed HTTP: (request, timing) pairs and the phase's duration (first
    send to last finish)."""
    timings, duration, _ = asyncio.run(run_requests(url, requests, "http", progress=False, warm_up=False))
    return list(zip(requests, timings, strict=True)), duration


def phase_metrics(pairs: list[tuple[Request, RequestTiming]], duration_s: float, cfg: MixConfig) -> dict:
    """Per class figures of one (policy, load) phase."""
    out: dict[str, Any] = {"duration_s": duration_s}
    rate_s = max(duration_s, 1e-9)  # a phase with no request at all lasts 0 s
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
            m["goodput_rps"] = good / rate_s
        else:
            # Batch work is served when it is done: its rate is what it moved over the phase.
            m["throughput_tok_s"] = m["tokens"] / rate_s
            m["output_throughput_tok_s"] = m["output_tokens"] / rate_s
        out[name] = m
    return out


def meets_bar(attainment: float | None, bar: float) -> bool:
    """Whether a phase's chat attainment reaches `bar`; None (no chat arrived) misses nothing."""
    return (1.0 if attainment is None else attainment) >= bar


@dataclass(frozen=True)
class Calibration:
    """What the machine does with this mix's requests, each kind alone, measured on an fcfs server."""

    ttft_s: float  # median TTFT of a chat served alone
    tpot_s: float  # median TPOT of a chat served alone
    burst_rps: float  # chats finished per second when BURST_CHATS arrive at once
    batch_prefill_s: float  # seconds to the last first token of one batch job of each kind sent together

    def targets(self) -> tuple[float, float]:
        """(TTFT, TBT) targets in ms: TBT 4x the unloaded inter-token time (room for a batch of decodes and
        a slice of prefill, not for a full prefill chunk on top), TTFT 10x a chat's prefill alone but never
        under 5 TBT targets (a queued chat waits some steps). Rounded up to 10 ms."""
        tbt = 10.0 * math.ceil(400.0 * self.tpot_s)
        ttft = max(10.0 * math.ceil(1000.0 * self.ttft_s), 5.0 * tbt)
        return ttft, tbt

    def num_batch(self, duration_s: float, share: float = 0.5) -> int:
        """Batch jobs (a multiple of the 3 kinds) whose prefills alone take about `share` of `duration_s`:
        a backlog that lasts through the phase on any machine, not one a fast CPU clears in its first second."""
        return 3 * max(1, round(share * duration_s / self.batch_prefill_s))

    def start_load(self) -> float:
        """A quarter of the burst rate, to two significant digits: well under capacity on any machine."""
        rate = self.burst_rps / 4.0
        return float(f"{rate:.2g}")


CALIBRATION_ALONE = 6  # chats sent one at a time
BURST_CHATS = 16  # chats sent at once


def calibrate(model: Path, cfg: MixConfig, tokenizer: Any | None, progress: bool = True) -> Calibration:
    """Requests of `cfg`'s shapes on a fresh fcfs server: CALIBRATION_ALONE chats one at a time (TTFT and
    TPOT of an unloaded server), BURST_CHATS at once (the rate the machine finishes chats at when saturated),
    then one batch job of each kind together (how long the machine takes to prefill them)."""
    chats = build_chats(cfg, CALIBRATION_ALONE + BURST_CHATS, cfg.seed + 10_000, tokenizer)
    jobs = build_mix(replace(cfg, num_batch=3), 1.0, cfg.seed + 20_000, tokenizer)[:3]
    server = InProcessServer(model, **cfg.engine_kwargs("fcfs"))
    try:
        url = server.url.rstrip("/")
        run_phase(url, [_warm_up()])
        alone = [run_phase(url, [c])[0][0][1] for c in chats[:CALIBRATION_ALONE]]
        pairs, duration = run_phase(url, chats[CALIBRATION_ALONE:])
        batch = [t for _, t in run_phase(url, jobs)[0]]
    finally:
        server.close()
    failed = [t.error for t in alone + [t for _, t in pairs] + batch if not t.success]
    if failed:
        raise RuntimeError(f"slo-mix calibration: requests failed: {failed[:3]}")
    result = Calibration(
        ttft_s=statistics.median(t.ttft_s for t in alone if t.ttft_s is not None),
        tpot_s=statistics.median(t.tpot_s for t in alone if t.tpot_s is not None),
        burst_rps=len(pairs) / duration,
        batch_prefill_s=max(t.ttft_s for t in batch if t.ttft_s is not None),
    )
    if progress:
        print(
            f"slo-mix: calibrated: a chat alone TTFT {1000 * result.ttft_s:.0f} ms, TPOT {1000 * result.tpot_s:.1f} ms;"
            f" {result.burst_rps:.2f} chats/s in a burst of {len(pairs)}; one batch job of each kind prefilled in "
            f"{result.batch_prefill_s:.2f} s",
            flush=True,
        )
    return result


def _warm_up() -> Request:
    return Request([{"role": "user", "content": "Warm up."}], 2, at_s=0.0)


def load_ladder(cfg: MixConfig, sweep: SweepConfig | None, start: float, met: list[bool]) -> Iterator[float]:
    """`cfg.loads`; with `sweep`, rates from `start` up by its factor while some policy meets the bar, or, if
    none met it at `start`, down until one does. `met[-1]`: whether some policy met it at the rate last given."""
    if sweep is None:
        yield from cfg.loads
        return
    load, step = start, sweep.factor
    for k in range(sweep.max_loads):
        yield float(f"{load:.3g}")
        if k == 0 and not met[-1]:
            step = 1.0 / sweep.factor
        elif (step > 1.0) != met[-1]:  # up and every policy missed, or down and one met: bracketed
            return
        load *= step


def bench_slo_mix(model: Path, cfg: MixConfig, progress: bool = True, sweep: SweepConfig | None = None) -> dict:
    """Every policy on every load (one in-process server per policy, all up for the whole run; the same
    requests for all, load by load). With `sweep`, the loads are its ladder (`load_ladder`): up until every
    policy misses the attainment bar, or down from the start until one meets it."""
    tokenizer = load_tokenizer(model)
    calibration: Calibration | None = None
    start = cfg.loads[0]
    if sweep is not None:
        if sweep.needs_calibration():
            calibration = calibrate(model, cfg, tokenizer, progress)
        start, ttft_ms, tbt_ms, num_batch = sweep.resolved(calibration, cfg.duration_s)
        cfg = replace(cfg, ttft_ms=ttft_ms, tbt_ms=tbt_ms, num_batch=num_batch)
        if progress:
            print(f"slo-mix: sweep from {start:g} chats/s, targets TTFT {cfg.ttft_ms:g} ms / TBT {cfg.tbt_ms:g} ms, "
                  f"{cfg.num_batch} batch jobs per load", flush=True)  # fmt: skip
    servers: dict[str, InProcessServer] = {}
    phases: dict[str, dict[str, int]] = {}
    results: dict[str, dict[str, dict]] = {policy: {} for policy in cfg.policies}
    try:
        for policy in cfg.policies:
            servers[policy] = InProcessServer(model, **cfg.engine_kwargs(policy))
            run_phase(servers[policy].url.rstrip("/"), [_warm_up()])
        met: list[bool] = []
        for i, load in enumerate(load_ladder(cfg, sweep, start, met)):
            requests = build_mix(cfg, load, cfg.seed + i, tokenizer)
            key = f"{load:g}"
            phases[key] = dict(Counter(r.kind for r in requests))
            for policy, server in servers.items():
                pairs, duration = run_phase(server.url.rstrip("/"), requests)
                m = results[policy][key] = phase_metrics(pairs, duration, cfg)
                m["errors"] = sorted({t.error for _, t in pairs if t.error})[:5]
                if progress:
                    print(f"slo-mix: {policy} @ {key} chats/s: {_line(m)}", flush=True)
            met.append(sweep is not None and any(
                meets_bar(by_load[key][INTERACTIVE]["slo_attainment"], sweep.attainment) for by_load in results.values()
            ))  # fmt: skip
    finally:
        for server in servers.values():
            server.close()
    report: dict[str, Any] = {
        "config": {**asdict(cfg), "model": str(model), "workload": "slo-mix"},
        "phases": phases,
        "results": results,
    }
    if sweep is not None:
        report["sweep"] = sweep_summary(results, sweep, calibration)
    return report


def capacity_at(loads: list[float], attainments: list[float | None], bar: float) -> tuple[float, str]:
    """The chat rate where attainment first falls below `bar`, interpolated in log(rate) between the last
    rate that met it and the first that did not. Returns (rate, bound): bound "interpolated"; "below" (the
    first rate already missed: capacity < rate) or "at least" (no rate missed: capacity >= the last)."""
    prev: tuple[float, float] | None = None
    for load, attainment in zip(loads, attainments, strict=True):
        a = 1.0 if attainment is None else attainment  # no chats arrived: none missed
        if not meets_bar(a, bar):
            if prev is None:
                return load, "below"
            lo, a_lo = prev
            frac = (a_lo - bar) / (a_lo - a)
            return math.exp(math.log(lo) + frac * (math.log(load) - math.log(lo))), "interpolated"
        prev = (load, a)
    return loads[-1], "at least"


def sweep_summary(results: dict[str, dict[str, dict]], sweep: SweepConfig, calibration: Calibration | None) -> dict:
    """Per policy: capacity at the attainment bar; against fcfs: goodput at every load and batch throughput
    at the policy's capacity load (the highest swept rate it still met the bar at)."""
    loads = sorted(next(iter(results.values())), key=float)
    out: dict[str, Any] = {
        "attainment_bar": sweep.attainment, "factor": sweep.factor, "loads": [float(x) for x in loads],
        "calibration": None if calibration is None else calibration.__dict__, "policies": {},
    }  # fmt: skip
    fcfs = results.get("fcfs")
    for policy, by_load in results.items():
        attain = [by_load[x][INTERACTIVE]["slo_attainment"] for x in loads]
        rate, bound = capacity_at([float(x) for x in loads], attain, sweep.attainment)
        met = [x for x, a in zip(loads, attain, strict=True) if meets_bar(a, sweep.attainment)]
        entry: dict[str, Any] = {"capacity_rps": rate, "capacity_bound": bound,
                                 "capacity_load": float(met[-1]) if met else None}  # fmt: skip
        if fcfs is not None:
            entry["goodput_vs_fcfs"] = {
                x: _ratio(by_load[x][INTERACTIVE]["goodput_rps"], fcfs[x][INTERACTIVE]["goodput_rps"]) for x in loads
            }
            entry["batch_throughput_vs_fcfs"] = {
                x: _ratio(by_load[x][BATCH]["throughput_tok_s"], fcfs[x][BATCH]["throughput_tok_s"]) for x in loads
            }
            entry["batch_throughput_vs_fcfs_at_capacity"] = (
                entry["batch_throughput_vs_fcfs"][met[-1]] if met else None
            )
        out["policies"][policy] = entry
    fcfs_entry = out["policies"].get("fcfs")
    for entry in out["policies"].values():
        if fcfs_entry is not None:
            entry["capacity_vs_fcfs"] = _capacity_ratio(entry, fcfs_entry)
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _capacity_ratio(entry: dict, fcfs: dict) -> float | None:
    """capacity / fcfs's when both are known rates; None when fcfs's is only "below" its first rate (the
    ratio is then unbounded) or either is only a lower bound."""
    if entry["capacity_bound"] == "below" or fcfs["capacity_bound"] != "interpolated":
        return None
    return entry["capacity_rps"] / fcfs["capacity_rps"]


def _line(m: dict) -> str:
    i, b = m[INTERACTIVE], m[BATCH]
    attain = "n/a" if i["slo_attainment"] is None else f"{100 * i['slo_attainment']:.0f}%"
    return (
        f"chat SLO {attain}, TTFT p50/p99 {i['median_ttft_ms']:.0f}/{i['p99_ttft_ms']:.0f} ms, "
        f"TPOT p50/p99 {i['median_tpot_ms']:.0f}/{i['p99_tpot_ms']:.0f} ms; "
        f"batch {b['throughput_tok_s']:.0f} tok/s, TTFT p50 {b['median_ttft_ms']:.0f} ms"
    )


def format_report(report: dict) -> str:
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
            i, b = by_load[load][INTERACTIVE], by_load[load][BATCH]
            attain = "n/a" if i["slo_attainment"] is None else f"{100 * i['slo_attainment']:.0f}% ({i['requests']})"
            ratio = _fmt(_ratio(b["throughput_tok_s"], fcfs[BATCH]["throughput_tok_s"]) if fcfs else None)
            rows.append(
                f"| {load} | {policy} | {attain} | {i['goodput_rps']:.2f} | "
                f"{i['median_ttft_ms']:.0f} / {i['p90_ttft_ms']:.0f} / {i['p99_ttft_ms']:.0f} | "
                f"{i['median_tpot_ms']:.0f} / {i['p99_tpot_ms']:.0f} | {b['median_ttft_ms']:.0f} | "
                f"{b['median_tpot_ms']:.0f} | {b['throughput_tok_s']:.0f} | {ratio} |"
            )
    errors = [f"{p} @ {load}: {e}" for p, by in report["results"].items() for load, m in by.items() for e in m["errors"]]
    if errors:
        rows.append("\nerrors: " + "; ".join(errors))
    if "sweep" in report:
        rows.append(format_sweep(report["sweep"]))
    return "\n".join(rows)


def format_sweep(sweep: dict) -> str:
    """The capacity table of a `--sweep`: one row per policy."""
    bar = 100 * sweep["attainment_bar"]
    rows = [
        f"\ncapacity at {bar:.0f}% chat SLO attainment (chat rates {', '.join(f'{x:g}' for x in sweep['loads'])}):\n",
        "| policy | capacity (chats/s) | vs fcfs | goodput vs fcfs, min over loads | batch tok/s vs fcfs at capacity |",
        "|---|---|---|---|---|",
    ]
    for policy, e in sweep["policies"].items():
        cap = {"below": "< ", "at least": ">= ", "interpolated": ""}[e["capacity_bound"]] + f"{e['capacity_rps']:.3g}"
        goodput = [r for r in e.get("goodput_vs_fcfs", {}).values() if r is not None]
        batch = e.get("batch_throughput_vs_fcfs_at_capacity")
        rows.append(
            f"| {policy} | {cap} | {_fmt(e.get('capacity_vs_fcfs'))} | {_fmt(min(goodput) if goodput else None)} | "
            f"{_fmt(batch)} |"
        )
    return "\n".join(rows)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
