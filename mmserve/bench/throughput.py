"""`mmserve bench throughput`: offline throughput of several systems on exactly the same requests, measured
in one process, with every figure also set against the model's dense-forward roofline."""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmserve.bench import ThroughputBenchConfig, num, summary, table
from mmserve.bench.hf_baselines import load_hf_model, run_hf_cb, run_hf_static
from mmserve.bench.long_video import step_engine, step_timeline
from mmserve.bench.machine import timed
from mmserve.bench.workload import Workload, offline_workload
from mmserve.engine.messages import StepRecord

if TYPE_CHECKING:
    from mmserve import LLM, SamplingParams

# system -> (scheduler policy, encoder chunking). mmserve-no-chunk is vLLM without chunked prefill: whole
# prefills, each media item encoded whole in the step that reaches it. (Encoder chunking alone, chunked
# prefill kept, is `mmserve bench long-video`'s on/off comparison.)
MMSERVE_SYSTEMS = {
    "mmserve": ("fcfs", True), "mmserve-no-chunk": ("no_chunk", False), "mmserve-static": ("static", True),
    "mmserve-structured": ("fcfs", True),  # mmserve with every request constrained by STRUCTURED_REGEX
    "mmserve-eager": ("fcfs", True),  # mmserve with --enforce-eager: no decode graphs (the same as mmserve off CUDA)
}  # fmt: skip
# JSON-like records, repeated: the grammar accepts after every record, so with ignore_eos (EOS is not
# offered while the grammar allows more) each request still runs to its fixed output length, as the
# unconstrained systems do; the outputs differ from theirs, the token counts do not.
STRUCTURED_REGEX = r'(\{"id": [0-9]{1,4}, "name": "[a-z ]{0,12}", "ok": (true|false)\}, )+'
# The keys of a system's report entry that only mmserve fills (None for transformers), in report order: see
# run_mmserve and, long-video only (else None), _arrival_stats.
MMSERVE_ONLY_KEYS = ("kv_cache_peak_usage", "step_time_split", "max_num_batched_tokens", "itl_p50_ms",
                     "itl_p99_ms", "max_step_s", "median_step_s", "max_encoder_tokens_in_a_step", "timeline",
                     "max_step_over_median", "max_step_since_video_s", "max_step_since_video_over_median",
                     "expert_share", "decode_graphs")  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One timed run of one system."""

    elapsed_s: float
    tokens: list[list[int]]  # greedy tokens per request, in workload order
    cpu_s: float  # this process's CPU seconds over the timed span
    mmserve: dict[str, Any] = field(default_factory=dict)  # mmserve only: its MMSERVE_ONLY_KEYS


def step_time_split(steps: Sequence[StepRecord], elapsed: float) -> dict[str, float]:
    """Fractions of a timed run from the engine core's step records: decoder forward (batch building and
    logits included), encoder, sampling, grammar; `host_overhead` is the rest — scheduling and update inside
    steps (`scheduler_and_update`) and everything between steps (`outside_steps`: detokenizing, the loop)."""
    parts = {name: sum(getattr(s, f"{name}_duration_s") for s in steps)
             for name in ("forward", "encoder", "sampling", "grammar")}  # fmt: skip
    measured, in_steps = sum(parts.values()), sum(s.duration_s for s in steps)
    parts |= {"host_overhead": max(0.0, elapsed - measured),
              "scheduler_and_update": max(0.0, in_steps - measured),
              "outside_steps": max(0.0, elapsed - in_steps)}  # fmt: skip
    return {k: v / elapsed for k, v in parts.items()}


def dense_token_rate(model: torch.nn.Module, vocab_size: int, num_tokens: int = 2048) -> float:
    """Tokens/s of one dense forward over `num_tokens` tokens (the best of 3): no engine is faster."""
    ids = torch.randint(100, vocab_size - 200, (1, num_tokens))
    with torch.inference_mode():
        model(input_ids=ids[:, :64], use_cache=False)  # warm-up
        best = min(timed(lambda: model(input_ids=ids, use_cache=False))[0] for _ in range(3))
    return num_tokens / best


class ExpertTimer:
    """Wall time inside every `SparseMoE` forward (router, top-k, fused experts) of a model, from forward
    pre/post hooks the bench adds and removes (the model code is unchanged). On a GPU each hook synchronizes
    first (else it would time kernel launches), slowing the run it measures a little. Nothing is timed for a
    dense model, nor for None (tensor-parallel ranks, in other processes the bench cannot hook)."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        from mmserve.models.moe import SparseMoE

        modules = [m for m in model.modules() if isinstance(m, SparseMoE)] if model is not None else []
        self.seconds = self._start = 0.0
        on_gpu = bool(modules) and next(modules[0].parameters()).device.type == "cuda"
        self._sync: Callable[[], None] = torch.cuda.synchronize if on_gpu else lambda: None
        self._handles = [h for m in modules for h in (m.register_forward_pre_hook(self._pre),
                                                      m.register_forward_hook(self._post))]  # fmt: skip

    def _pre(self, module: torch.nn.Module, args: tuple) -> None:
        self._sync()
        self._start = time.perf_counter()

    def _post(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._start

    def close(self, forward_s: float) -> float | None:
        """Removes the hooks; returns the timed seconds over `forward_s` (the decoder-forward seconds of
        the same span), or None with nothing timed."""
        for h in self._handles:
            h.remove()
        return self.seconds / forward_s if self._handles and forward_s > 0 else None


def run_mmserve(model_dir: Path, workload: Workload, system: str, c: ThroughputBenchConfig) -> Run:
    """All requests through `LLM.generate` at once, or (long-video) through the arrival driver."""
    from PIL import ImageOps

    from mmserve import LLM, SamplingParams
    from mmserve.request import StructuredOutputs

    policy, chunk_encoder = MMSERVE_SYSTEMS[system]
    budget = c.max_num_batched_tokens or 0
    if policy in ("no_chunk", "static"):  # these refuse a prompt longer than the budget
        budget = max(budget, max(len(p) for p in workload.prompts))
    llm = LLM(model_dir, scheduler_policy=policy, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=budget,
              max_num_encoder_tokens=c.max_num_encoder_tokens, chunk_encoder=chunk_encoder,
              encoder_token_cost=c.encoder_token_cost, enforce_eager=system == "mmserve-eager")  # fmt: skip
    spec = StructuredOutputs(regex=STRUCTURED_REGEX) if system == "mmserve-structured" else None
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, structured_outputs=spec)
              for n in workload.output_lens]  # fmt: skip
    prompts = [p if workload.is_text(i) else workload.mm_prompts[i] for i, p in enumerate(workload.prompts)]
    # Warm-up: the first and last requests' shapes with other content (no prefix- or encoder-cache hits in the
    # timed run): text reversed, images inverted, videos cut to 4 inverted frames.
    llm.generate([p[::-1] if not isinstance(p, dict) else
                  {"prompt": p["prompt"], "images": [ImageOps.invert(im) for im in p.get("images", [])],
                   "videos": [255 - v[:4] for v in p.get("videos", [])]} for p in (prompts[0], prompts[-1])],
                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # fmt: skip
    timer = ExpertTimer(llm.engine.executor.local_model())
    llm.step_records.clear()
    if workload.arrival_steps is None:
        elapsed, outputs, cpu_s = timed(lambda: llm.generate(prompts, params))
        tokens, arrivals = [o.token_ids for o in outputs], {}
    else:
        elapsed, (tokens, stamps, first_video), cpu_s = timed(lambda: _drive(llm, workload, prompts, params))
        arrivals = _arrival_stats(llm, workload, stamps, first_video)
    stats = llm.stats()
    graph_mode, graph_sizes, replays = llm.engine.executor.decode_graphs()
    return Run(elapsed, tokens, cpu_s, {
        "kv_cache_peak_usage": stats.peak_num_used_blocks / stats.num_total_blocks,
        "step_time_split": step_time_split(llm.step_records, elapsed),
        "max_num_batched_tokens": llm.engine.scheduler_config.max_num_batched_tokens,  # as it ran
        **arrivals,
        # MoE models: seconds inside SparseMoE forwards (router + experts) over the decoder-forward
        # seconds of the timed run's step records; None for a dense model.
        "expert_share": timer.close(sum(s.forward_duration_s for s in llm.step_records)),
        # "off" | "cuda": decode steps replayed from graphs, over the engine's life (warm-up included)
        "decode_graphs": {"mode": graph_mode, "sizes": list(graph_sizes), "replayed_steps": sum(replays.values())},
    })  # fmt: skip


def _drive(llm: LLM, workload: Workload, prompts: list,
           params: list[SamplingParams]) -> tuple[list[list[int]], list[list[float]], int]:  # fmt: skip
    """Steps the engine by hand, adding request i after `arrival_steps[i]` steps and stamping each output
    token with the time its step returned. Returns the tokens and stamps per request and the index in
    `llm.step_records` of the first step after the first media request was added. Every request is
    preprocessed before the loop (a server does it off the engine loop, in its decode pool: it must not show
    as a stall of the decodes); the caller's timed span still counts it, as generate()'s and hf-static's."""
    from mmserve.errors import EngineDeadError

    requests = [llm.processor.process(p, sp, f"r{i}")[0]
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]  # fmt: skip
    order = {r.request_id: i for i, r in enumerate(requests)}
    arrival_steps = workload.arrival_steps or []
    pending = deque(sorted(range(len(requests)), key=lambda i: arrival_steps[i]))  # request indices
    tokens: list[list[int]] = [[] for _ in requests]
    stamps: list[list[float]] = [[] for _ in requests]
    step = idle = 0
    first_video_step = None
    while pending or llm.engine.has_unfinished_requests():
        while pending and arrival_steps[pending[0]] <= step:
            i = pending.popleft()
            if first_video_step is None and not workload.is_text(i):
                first_video_step = len(llm.step_records)
            llm.engine.add_request(requests[i])
        core_outputs = step_engine(llm)
        now = time.perf_counter()
        for out in core_outputs.outputs:
            tokens[order[out.request_id]].extend(out.new_token_ids)
            stamps[order[out.request_id]].extend([now] * len(out.new_token_ids))
        step += 1
        # Nothing produced, nothing running and nothing left to arrive: nothing ever will (as generate()).
        idle = 0 if core_outputs.outputs or core_outputs.stats.num_running or pending else idle + 1
        if idle > 1:
            raise EngineDeadError("the scheduler admits nothing while no request runs")
    return tokens, stamps, first_video_step or 0


def _arrival_stats(llm: LLM, workload: Workload, stamps: list[list[float]], first_video_step: int) -> dict:
    """long-video's keys of an mmserve entry: inter-token latency of the text decodes (gaps between
    consecutive tokens of one request, pooled over the text requests), step times, and every timed step's
    composition."""
    gaps = np.concatenate([np.diff(s) for i, s in enumerate(stamps) if workload.is_text(i) and len(s) > 1]
                          or [np.zeros(0)])  # [num gaps] seconds  # fmt: skip
    itl_ms = [float(x) * 1e3 for x in np.percentile(gaps, [50, 99])] if len(gaps) else [None, None]
    times = [s.duration_s for s in llm.step_records]
    median = float(np.median(times))
    # The longest step from the first video's arrival on (the text prefills before it left out): what a
    # long video joining running decodes does to them.
    since_video = max(times[first_video_step:] or [0.0])
    return {
        "itl_p50_ms": itl_ms[0], "itl_p99_ms": itl_ms[1], "max_step_s": max(times), "median_step_s": median,
        "max_encoder_tokens_in_a_step": max(s.num_encoder_tokens for s in llm.step_records),
        "timeline": step_timeline(llm.step_records), "max_step_over_median": max(times) / median,
        "max_step_since_video_s": since_video, "max_step_since_video_over_median": since_video / median,
    }  # fmt: skip


def _system_entry(system: str, runs: list[Run], run: Run, workload: Workload, bound: float) -> dict[str, Any]:
    """A system's figures: those of `run`, its median run, and with repeats every run's too."""
    repeated = len(runs) > 1
    out_rate = workload.num_output_tokens / run.elapsed_s
    return {
        "system": system, "elapsed_s": run.elapsed_s, "requests_per_s": len(workload.prompts) / run.elapsed_s,
        "output_tokens_per_s": out_rate,
        "total_tokens_per_s": (workload.num_prompt_tokens + workload.num_output_tokens) / run.elapsed_s,
        "efficiency": out_rate / bound,  # output tokens/s over the roofline bound
        "ratio_to_hf_static": None,  # output tokens/s over hf-static's, when it ran
        **dict.fromkeys(MMSERVE_ONLY_KEYS), **run.mmserve,
        "elapsed_s_runs": [r.elapsed_s for r in runs] if repeated else None,  # in run order
        "expert_share_runs": [r.mmserve["expert_share"] for r in runs]
        if repeated and run.mmserve.get("expert_share") is not None else None,
        # CPU seconds this process spent in the timed span (all its threads; child processes not counted):
        # on a shared machine it moves far less than wall time when others take the cores. The median
        # run's, every run's, and hf-static's median over this system's.
        "cpu_s": statistics.median_low([r.cpu_s for r in runs]),
        "cpu_s_runs": [r.cpu_s for r in runs] if repeated else None, "cpu_ratio_to_hf_static": None,
    }  # fmt: skip


def bench_throughput(model_dir: Path, config: ThroughputBenchConfig, progress: bool = False) -> dict:
    """Every system on the same workload, `repeats` times round-robin (so drift on a shared machine
    hits every system alike); each system reports its median run, the roofline its best measurement."""
    from tqdm import tqdm

    from mmserve.models.config import DecoderConfig

    c = config.resolved()
    cfg, _ = DecoderConfig.from_pretrained(model_dir)
    workload = offline_workload(model_dir, c, cfg.vocab_size)
    hf_model = load_hf_model(model_dir)
    rooflines: list[float] = []
    runs: dict[str, list[Run]] = {k: [] for k in c.systems}  # one per repeat
    with tqdm(total=c.repeats * len(c.systems), desc="bench throughput", disable=not progress) as bar:
        for _ in range(c.repeats):
            rooflines.append(dense_token_rate(hf_model, cfg.vocab_size))
            for system in c.systems:
                hf = {"hf-static": run_hf_static, "hf-cb": run_hf_cb}.get(system)  # (wall s, tokens, CPU s)
                runs[system].append(Run(*hf(hf_model, model_dir, workload, c)) if hf else
                                    run_mmserve(model_dir, workload, system, c))  # fmt: skip
                gc.collect()
                bar.update()
    roofline = max(rooflines)  # a ceiling: noise only ever makes a measurement of it lower
    bound = roofline * workload.num_output_tokens / (workload.num_prompt_tokens + workload.num_output_tokens)
    # Each system's median run by wall time (of an even count, the faster middle one).
    median_runs = {k: sorted(v, key=lambda r: r.elapsed_s)[(len(v) - 1) // 2] for k, v in runs.items()}
    systems = {k: _system_entry(k, v, median_runs[k], workload, bound) for k, v in runs.items()}
    reference = median_runs[c.systems[0]].tokens
    if (base := systems.get("hf-static")) is not None:
        for entry in systems.values():
            entry["ratio_to_hf_static"] = entry["output_tokens_per_s"] / base["output_tokens_per_s"]
            entry["cpu_ratio_to_hf_static"] = base["cpu_s"] / entry["cpu_s"] if entry["cpu_s"] else None
    return {
        "config": {**asdict(c), "model": str(model_dir), "torch_threads": torch.get_num_threads()},
        "workload": {"prompt_tokens": workload.num_prompt_tokens, "output_tokens": workload.num_output_tokens,
                     "video_tokens": workload.video_tokens,  # placeholder tokens of one video
                     # long-video: the driver step after which each video request is added
                     "video_arrival_steps": [a for i, a in enumerate(workload.arrival_steps or [])
                                             if not workload.is_text(i)]},
        "roofline_tokens_per_s": roofline, "roofline_tokens_per_s_runs": rooflines,
        "output_tokens_per_s_bound": bound,
        "systems": systems,
        # Greedy outputs of every system should agree: how many requests differ from the first system's
        # median run, in the worst run of each system.
        "outputs_differing_from_first_system": {
            k: max(sum(a != b for a, b in zip(r.tokens, reference, strict=True)) for r in v)
            for k, v in runs.items()
        },
        **_comparisons(systems),
    }  # fmt: skip


def _comparisons(systems: dict[str, dict]) -> dict:
    """mmserve against mmserve-no-chunk: the throughput chunking costs (1 - chunked / unchunked output
    tokens/s; negative: chunking is faster) and (long-video) the tail ITL it buys. mmserve-structured against
    mmserve: the share of its run spent filling bitmasks and advancing matchers, and its wall time over the
    unconstrained run's (same requests, same lengths). mmserve against mmserve-eager: what decode graphs give
    (output tokens/s with over without; 1.0 off CUDA, where neither captures). Each only when both ran."""
    plain, whole, structured, eager = (systems.get(k) for k in ("mmserve", "mmserve-no-chunk", "mmserve-structured",
                                                                 "mmserve-eager"))  # fmt: skip
    out: dict[str, Any] = {}
    if plain is not None and eager is not None:
        out["decode_graphs_speedup"] = plain["output_tokens_per_s"] / eager["output_tokens_per_s"]
    if plain is not None and whole is not None:
        out["throughput_cost_of_chunking"] = 1 - plain["output_tokens_per_s"] / whole["output_tokens_per_s"]
        if plain["itl_p99_ms"] is not None and whole["itl_p99_ms"]:
            out["p99_itl_chunk_over_no_chunk"] = plain["itl_p99_ms"] / whole["itl_p99_ms"]
    if plain is not None and structured is not None:
        out["structured_overhead"] = {
            "grammar_share_of_run": structured["step_time_split"]["grammar"],
            "elapsed_over_unconstrained": structured["elapsed_s"] / plain["elapsed_s"],
        }
    return out


def format_report(report: dict) -> str:
    systems = list(report["systems"].values())
    rows = [(r["system"], num(r["requests_per_s"], ".2f"), num(r["output_tokens_per_s"]),
             num(r["total_tokens_per_s"]), num(r["efficiency"], ".0%"), num(r["ratio_to_hf_static"], ".2f"),
             num(r["cpu_s"]), num(r["cpu_ratio_to_hf_static"], ".2f")) for r in systems]  # fmt: skip
    parts = [summary([("Roofline, 2048-token forward (tok/s):", num(report["roofline_tokens_per_s"], ".0f")),
                      ("Output-token bound (tok/s):", num(report["output_tokens_per_s_bound"]))]),
             table(("system", "req/s", "out tok/s", "total tok/s", "efficiency", "vs hf-static", "CPU s",
                    "CPU vs hf"), rows)]  # fmt: skip
    # step_time_split's fractions, in its order (host: host_overhead; between: outside_steps)
    if rows := [(r["system"], *(num(v, ".0%") for v in r["step_time_split"].values()),
                 num(r["kv_cache_peak_usage"], ".1%"), num(r["expert_share"], ".0%"))
                for r in systems if r["step_time_split"]]:  # fmt: skip
        parts.append("== share of the run (host: sched+update inside steps, and between steps) ==\n" + table(
            ("system", "forward", "encoder", "sampling", "grammar", "host", "sched+update", "between",
             "KV peak", "experts"), rows))  # fmt: skip
    if rows := [(r["system"], num(r["itl_p50_ms"]), num(r["itl_p99_ms"]), len(r["timeline"]),
                 num(r["max_step_s"] * 1e3), num(r["median_step_s"] * 1e3),
                 num(r["max_step_over_median"], ".2f"),
                 num(r["max_step_since_video_s"] * 1e3), num(r["max_step_since_video_over_median"], ".2f"),
                 r["max_encoder_tokens_in_a_step"], r["max_num_batched_tokens"])
                for r in systems if r["timeline"] is not None]:  # fmt: skip
        parts.append(f"== long-video, ms (a video is {report['workload']['video_tokens']} tokens; since "
                     "video: from the first video's arrival on) ==\n" + table(
            ("system", "ITL p50", "ITL p99", "steps", "max step", "median", "max/med", "since video", "/med",
             "enc tokens", "budget"), rows))  # fmt: skip
    if (repeats := report["config"]["repeats"]) > 1:
        rows = [("roofline tok/s", *(num(x, ".0f") for x in report["roofline_tokens_per_s_runs"]))]
        rows += [(f"{r['system']} wall s", *(num(t) for t in r["elapsed_s_runs"])) for r in systems]
        rows += [(f"{r['system']} experts", *(num(x, ".0%") for x in r["expert_share_runs"]))
                 for r in systems if r["expert_share_runs"]]  # fmt: skip
        parts.append("== every run, interleaved (the figures above: each system's median run) ==\n"
                     + table(("run", *map(str, range(1, repeats + 1))), rows))  # fmt: skip
    ratios = [("p99 text ITL, mmserve / no-chunk:", report.get("p99_itl_chunk_over_no_chunk"), ".2f"),
              ("Throughput cost of chunking:", report.get("throughput_cost_of_chunking"), ".1%"),
              ("Output tok/s, decode graphs / eager:", report.get("decode_graphs_speedup"), ".2f")]
    if shown := [(label, num(value, spec)) for label, value, spec in ratios if value is not None]:
        parts.append(summary(shown))
    return "\n".join(parts)
