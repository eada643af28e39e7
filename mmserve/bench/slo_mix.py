"""`mmserve bench serve --workload slo-mix`: chats over a backlog of batch jobs, at several chat loads, under
the fcfs, priority and slo policies side by side: per class latency, chat SLO attainment, goodput, batch
throughput and (`--sweep`) each policy's capacity. Speaks the HTTP API only, never the engine's internals."""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mmserve.bench import MixConfig, SweepConfig, num, table
from mmserve.bench.load import WARM_UP, run_requests
from mmserve.bench.metrics import RequestTiming, meets_slos, ratio, summarize_ms
from mmserve.bench.servers import InProcessServer
from mmserve.bench.workload import BATCH, INTERACTIVE, Request, build_chats, build_mix, load_tokenizer

QUICK_MIX = MixConfig().quick()  # what --quick runs
_WARM_UP = replace(WARM_UP, at_s=0.0)  # a phase's requests all carry their offsets


def run_phase(url: str, requests: list[Request]) -> tuple[list[RequestTiming], float]:
    """Each request at its offset over streamed HTTP: the timings (in `requests`' order) and the phase's
    duration (first send to last finish)."""
    return asyncio.run(run_requests(url, requests, "http", progress=False, warm_up=False))[:2]


def phase_metrics(pairs: list[tuple[Request, RequestTiming]], duration_s: float, cfg: MixConfig) -> dict:
    """Per class figures of one (policy, load) phase."""
    out: dict[str, Any] = {"duration_s": duration_s}
    rate_s = max(duration_s, 1e-9)  # a phase with no request at all lasts 0 s
    for name in (INTERACTIVE, BATCH):
        timings = [t for r, t in pairs if r.service_class == name]
        ok = [t for t in timings if t.success]
        m: dict[str, Any] = {"requests": len(timings), "completed": len(ok), "failed": len(timings) - len(ok)}
        m |= summarize_ms([t.ttft_s for t in ok if t.ttft_s is not None], "ttft")
        m |= summarize_ms([t.tpot_s for t in ok if t.tpot_s is not None], "tpot")
        m["tokens"] = sum(t.prompt_tokens + t.output_tokens for t in ok)
        m["output_tokens"] = sum(t.output_tokens for t in ok)
        if name == INTERACTIVE:
            # vLLM's goodput rule: TBT is judged on the request's TPOT (one token: 0). Per second of the chats'
            # arrival window, the same for every policy: not of the phase, whose end the batch backlog's tail
            # sets (a policy that leaves batch work for later would see its chats' goodput divided by it).
            good = sum(meets_slos(t, {"ttft": cfg.ttft_ms, "tpot": cfg.tbt_ms}) for t in timings)
            m["slo_attainment"] = good / len(timings) if timings else None
            m["goodput_rps"] = good / cfg.duration_s
        else:
            # Batch work is served when it is done: its rate is what it moved over the phase.
            m["throughput_tok_s"] = m["tokens"] / rate_s
            m["output_throughput_tok_s"] = m["output_tokens"] / rate_s
        out[name] = m
    return out


def meets_bar(attainment: float | None, bar: float) -> bool:
    """Whether a phase's chat attainment reaches `bar`; None (no chat arrived) shows nothing either way, so it
    does not count as met (a sweep stepping down must not stop at a rate where no chat came)."""
    return attainment is not None and attainment >= bar


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
        return max(10.0 * math.ceil(1000.0 * self.ttft_s), 5.0 * tbt), tbt

    def num_batch(self, duration_s: float) -> int:
        """Batch jobs (a multiple of the 3 kinds) whose prefills alone take about half of `duration_s`: a
        backlog that lasts through the phase on any machine, not one a fast CPU clears in its first second."""
        return 3 * max(1, round(0.5 * duration_s / self.batch_prefill_s))

    def start_load(self) -> float:
        """A quarter of the burst rate, to two significant digits: well under capacity on any machine."""
        return float(f"{self.burst_rps / 4.0:.2g}")


CALIBRATION_ALONE = 6  # chats sent one at a time
BURST_CHATS = 16  # chats sent at once


def calibrate(model: Path, cfg: MixConfig, tokenizer: Any | None, progress: bool = True) -> Calibration:
    """Requests of `cfg`'s shapes on a fresh fcfs server: CALIBRATION_ALONE chats one at a time (TTFT and
    TPOT of an unloaded server), BURST_CHATS at once (the rate the machine finishes chats at when saturated),
    then one batch job of each kind together (how long the machine takes to prefill them)."""
    chats = build_chats(cfg, CALIBRATION_ALONE + BURST_CHATS, cfg.seed + 10_000, tokenizer)
    jobs = build_mix(replace(cfg, num_batch=3), 1.0, cfg.seed + 20_000, tokenizer)[:3]
    with contextlib.closing(InProcessServer(model, **cfg.engine_kwargs("fcfs"))) as server:
        run_phase(server.url, [_WARM_UP])
        alone = [run_phase(server.url, [c])[0][0] for c in chats[:CALIBRATION_ALONE]]
        burst, duration = run_phase(server.url, chats[CALIBRATION_ALONE:])
        batch = run_phase(server.url, jobs)[0]
    if failed := [t.error for t in alone + burst + batch if not t.success]:
        raise RuntimeError(f"slo-mix calibration: requests failed: {failed[:3]}")
    result = Calibration(ttft_s=statistics.median(t.ttft_s for t in alone if t.ttft_s is not None),
                         tpot_s=statistics.median(t.tpot_s for t in alone if t.tpot_s is not None),
                         burst_rps=len(burst) / duration,
                         batch_prefill_s=max(t.ttft_s for t in batch if t.ttft_s is not None))  # fmt: skip
    if progress:
        print(f"slo-mix: calibrated: a chat alone TTFT {1000 * result.ttft_s:.0f} ms, TPOT {1000 * result.tpot_s:.1f} ms;"
              f" {result.burst_rps:.2f} chats/s in a burst of {len(burst)}; one batch job of each kind prefilled in "
              f"{result.batch_prefill_s:.2f} s", flush=True)  # fmt: skip
    return result


def load_ladder(cfg: MixConfig, sweep: SweepConfig | None, start: float, met: list[bool]) -> Iterator[float]:
    """`cfg.loads`; with `sweep`, rates from `start` up by its factor while some policy meets the bar, or,
    if none met it at `start`, down until one does. `met[-1]`: whether some policy met it at the last rate
    (None: no chat arrived there; going down it ends the ladder, since lower rates bring fewer still)."""
    if sweep is None:
        yield from cfg.loads
        return
    load, step = start, sweep.factor
    for k in range(sweep.max_loads):
        yield float(f"{load:.3g}")
        if met[-1] is None:
            if step < 1.0:
                return
        elif k == 0 and not met[-1]:
            step = 1.0 / sweep.factor
        elif (step > 1.0) != met[-1]:  # up and every policy missed, or down and one met: bracketed
            return
        load *= step


def bench_slo_mix(model: Path, cfg: MixConfig, progress: bool = True, sweep: SweepConfig | None = None) -> dict:
    """Every policy on every load: chats (short text, single images) arriving as a Poisson process over a
    backlog of batch jobs (long prompts, multi-image, long videos; service_tier "flex" and priority 1 mark
    them), the same requests at the same offsets for every policy, each on its own in-process server (all up
    for the whole run).

    With `sweep`, the loads are its ladder (`load_ladder`): up until every policy misses the attainment bar,
    or down from the start until one meets it; each policy's capacity (the rate at the bar, as Sarathi-Serve
    and DistServe state it) is reported. Targets and the first rate not given are derived from a short
    measurement of the machine at start (`calibrate`), so the same command stresses a slow and a fast CPU
    alike."""
    tokenizer = load_tokenizer(model)
    calibration = calibrate(model, cfg, tokenizer, progress) if sweep and sweep.needs_calibration() else None
    start = cfg.loads[0]
    if sweep is not None:
        start, ttft_ms, tbt_ms, num_batch = sweep.resolved(calibration, cfg.duration_s)
        cfg = replace(cfg, ttft_ms=ttft_ms, tbt_ms=tbt_ms, num_batch=num_batch)
        if progress:
            print(f"slo-mix: sweep from {start:g} chats/s, targets TTFT {cfg.ttft_ms:g} ms / TBT "
                  f"{cfg.tbt_ms:g} ms, {cfg.num_batch} batch jobs per load", flush=True)  # fmt: skip
    phases: dict[str, dict[str, int]] = {}  # load -> its requests of each kind
    results: dict[str, dict[str, dict]] = {policy: {} for policy in cfg.policies}  # policy -> load -> figures
    met: list[bool | None] = []
    with contextlib.ExitStack() as stack:  # every policy's server, up (and warm) for the whole run
        urls = {p: stack.enter_context(contextlib.closing(InProcessServer(model, **cfg.engine_kwargs(p)))).url
                for p in cfg.policies}  # fmt: skip
        for url in urls.values():
            run_phase(url, [_WARM_UP])
        for i, load in enumerate(load_ladder(cfg, sweep, start, met)):
            requests = build_mix(cfg, load, cfg.seed + i, tokenizer)
            key = f"{load:g}"
            phases[key] = dict(Counter(r.kind for r in requests))
            for policy, url in urls.items():
                timings, duration = run_phase(url, requests)
                m = results[policy][key] = phase_metrics(list(zip(requests, timings, strict=True)), duration, cfg)
                m["errors"] = sorted({t.error for t in timings if t.error})[:5]
                if progress:  # one phase in a line
                    i, b = m[INTERACTIVE], m[BATCH]
                    print(f"slo-mix: {policy} @ {key} chats/s: chat SLO {num(i['slo_attainment'], '.0%')}, "
                          f"TTFT p50/p99 {_ms(i, 'ttft', 'median', 'p99')} ms, TPOT p50/p99 "
                          f"{_ms(i, 'tpot', 'median', 'p99')} ms; batch {b['throughput_tok_s']:.0f} tok/s, "
                          f"TTFT p50 {_ms(b, 'ttft', 'median')} ms", flush=True)  # fmt: skip
            attainments = [by_load[key][INTERACTIVE]["slo_attainment"] for by_load in results.values()]
            chats = [a for a in attainments if a is not None]
            met.append(None if not chats else sweep is not None and any(meets_bar(a, sweep.attainment) for a in chats))
    report = {"config": {**asdict(cfg), "model": str(model), "workload": "slo-mix"}, "phases": phases,
              "results": results}  # fmt: skip
    return report if sweep is None else report | {"sweep": sweep_summary(results, sweep, calibration)}


def capacity_at(loads: list[float], attainments: list[float | None], bar: float) -> tuple[float | None, str]:
    """The chat rate where attainment first falls below `bar`, interpolated in log(rate) between the last
    rate that met it and the first that did not. Returns (rate, bound): bound "interpolated"; "below" (the
    first rate already missed: capacity < rate); "at least" (no rate missed: capacity >= the last); or
    (None, "unmeasured") when no chat arrived at any rate. Rates where no chat arrived are skipped."""
    measured = [(load, a) for load, a in zip(loads, attainments, strict=True) if a is not None]
    if not measured:
        return None, "unmeasured"
    prev: tuple[float, float] | None = None
    for load, a in measured:
        if not meets_bar(a, bar):
            if prev is None:
                return load, "below"
            lo, a_lo = prev
            frac = (a_lo - bar) / (a_lo - a)
            return math.exp(math.log(lo) + frac * (math.log(load) - math.log(lo))), "interpolated"
        prev = (load, a)
    return measured[-1][0], "at least"


def sweep_summary(results: dict[str, dict[str, dict]], sweep: SweepConfig, calibration: Calibration | None) -> dict:
    """Per policy: capacity at the attainment bar; against fcfs: goodput and batch throughput at every load,
    batch throughput at the policy's capacity load (the highest swept rate it still met the bar at), and
    capacity where both are known rates (None when fcfs's is only "below" its first rate: the ratio is then
    unbounded; or when either is only "at least" a rate)."""
    loads = sorted(next(iter(results.values())), key=float)
    rates = [float(x) for x in loads]
    fcfs = results.get("fcfs")
    attainments = {p: [by_load[x][INTERACTIVE]["slo_attainment"] for x in loads] for p, by_load in results.items()}
    capacities = {p: capacity_at(rates, a, sweep.attainment) for p, a in attainments.items()}
    policies: dict[str, dict] = {}
    for policy, by_load in results.items():
        rate, bound = capacities[policy]
        met = [x for x, a in zip(loads, attainments[policy], strict=True) if meets_bar(a, sweep.attainment)]
        entry = policies[policy] = {"capacity_rps": rate, "capacity_bound": bound,
                                    "capacity_load": float(met[-1]) if met else None}  # fmt: skip
        if fcfs is not None:  # goodput and batch throughput: load -> the policy's over fcfs's
            goodput, batch = ({x: ratio(by_load[x][c][k], fcfs[x][c][k]) for x in loads}
                              for c, k in ((INTERACTIVE, "goodput_rps"), (BATCH, "throughput_tok_s")))  # fmt: skip
            fcfs_rate, fcfs_bound = capacities["fcfs"]
            known = rate is not None and bound != "below" and fcfs_bound == "interpolated"
            entry |= {"goodput_vs_fcfs": goodput,
                      "batch_throughput_vs_fcfs": batch,
                      "batch_throughput_vs_fcfs_at_capacity": batch[met[-1]] if met else None,
                      "capacity_vs_fcfs": rate / fcfs_rate if known else None}  # fmt: skip
    return {"attainment_bar": sweep.attainment, "factor": sweep.factor, "loads": rates,
            "calibration": None if calibration is None else asdict(calibration), "policies": policies}  # fmt: skip


def _ms(m: dict, figure: str, *stats: str) -> str:
    """One class's `figure` (ttft, tpot) at each of `stats` (median, p90, ...), in whole ms, "/"-joined."""
    return "/".join(num(m[f"{stat}_{figure}_ms"], ".0f") for stat in stats)


def format_report(report: dict) -> str:
    """The run's targets, one row per (load, policy), then the errors and (`--sweep`) the capacities."""
    cfg, results = report["config"], report["results"]
    rows = []
    for load in next(iter(results.values())):
        fcfs = results.get("fcfs", {}).get(load)
        for policy, by_load in results.items():
            i, b = by_load[load][INTERACTIVE], by_load[load][BATCH]
            vs_fcfs = ratio(b["throughput_tok_s"], fcfs[BATCH]["throughput_tok_s"]) if fcfs else None
            rows.append((load, policy, f"{num(i['slo_attainment'], '.0%')} ({i['requests']})",
                         num(i["goodput_rps"], ".2f"), _ms(i, "ttft", "median", "p90", "p99"),
                         _ms(i, "tpot", "median", "p99"), _ms(b, "ttft", "median"), _ms(b, "tpot", "median"),
                         num(b["throughput_tok_s"], ".0f"), num(vs_fcfs, ".2f")))  # fmt: skip
    header = ("chats/s", "policy", "chat SLO met", "chat goodput (req/s)", "chat TTFT p50/p90/p99 (ms)",
              "chat TPOT p50/p99 (ms)", "batch TTFT p50 (ms)", "batch TPOT p50 (ms)", "batch tok/s", "vs fcfs")
    parts = [f"slo-mix on {cfg['model']}: interactive SLO TTFT <= {cfg['ttft_ms']:g} ms and TPOT <= "
             f"{cfg['tbt_ms']:g} ms; {cfg['num_batch']} batch jobs per load, {cfg['duration_s']:g} s of "
             "chats per load\n", table(header, rows)]  # fmt: skip
    if errors := [f"{p} @ {load}: {e}" for p, by in results.items() for load, m in by.items() for e in m["errors"]]:
        parts.append("\nerrors: " + "; ".join(errors))
    if "sweep" in report:
        parts.append(format_sweep(report["sweep"]))
    return "\n".join(parts)


def format_sweep(sweep: dict) -> str:
    """The capacity table of a `--sweep`: one row per policy."""
    rows = []
    for policy, e in sweep["policies"].items():
        bound = {"below": "< ", "at least": ">= ", "interpolated": ""}.get(e["capacity_bound"])
        capacity = "no chat arrived" if bound is None else bound + f"{e['capacity_rps']:.3g}"
        goodput = [r for r in e.get("goodput_vs_fcfs", {}).values() if r is not None]
        rows.append((policy, capacity, num(e.get("capacity_vs_fcfs"), ".2f"),
                     num(min(goodput, default=None), ".2f"), num(e.get("batch_throughput_vs_fcfs_at_capacity"), ".2f")))
    loads = ", ".join(f"{x:g}" for x in sweep["loads"])
    title = f"capacity at {100 * sweep['attainment_bar']:.0f}% chat SLO attainment (chat rates {loads})"
    header = ("policy", "capacity (chats/s)", "vs fcfs", "goodput vs fcfs, min over loads", "batch tok/s vs fcfs at capacity")
    return f"\n{title}:\n" + table(header, rows)
