"""`mmserve bench throughput`: offline throughput of several systems on exactly the same requests,
measured in one process, with every figure also set against the model's dense-forward roofline."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmserve.bench import ThroughputBenchConfig
from mmserve.bench.hf_baselines import load_hf_model, run_hf_cb, run_hf_static
from mmserve.bench.workload import Workload, offline_workload
from mmserve.engine.messages import StepRecord

if TYPE_CHECKING:
    from mmserve import LLM, SamplingParams


@dataclass(frozen=True)
class SystemResult:
    system: str
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    efficiency: float  # output tokens/s over the roofline bound
    ratio_to_hf_static: float | None = None
    kv_cache_peak_usage: float | None = None
    # mmserve only: fractions of the timed run (forward, encoder, sampling, host overhead), see step_time_split
    step_time_split: dict | None = None
    # mmserve only: the token budget it ran with (systems that never chunk a prefill get at least the
    # longest prompt, as vLLM without chunked prefill: otherwise it could not be admitted).
    max_num_batched_tokens: int | None = None
    # long-video, mmserve only: inter-token latency of the text decodes (gaps between consecutive tokens
    # of one request, pooled over the text requests), step times, and every timed step's composition.
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    max_step_s: float | None = None
    median_step_s: float | None = None
    max_encoder_tokens_in_a_step: int | None = None
    timeline: list[dict] | None = None
    max_step_over_median: float | None = None  # long-video: longest step / median step
    # long-video: the longest step from the first video's arrival on (the text prefills before it left
    # out), and it over the median step: what a long video joining running decodes does to them.
    max_step_since_video_s: float | None = None
    max_step_since_video_over_median: float | None = None
    # mmserve on an MoE model: seconds inside SparseMoE forwards (router + experts) over decoder-forward
    # seconds of the timed run's step records (see ExpertTimer); None for a dense model.
    expert_share: float | None = None
    # With repeats > 1: every run's wall time, in run order; the other figures are the median run's.
    elapsed_s_runs: list[float] | None = None
    expert_share_runs: list[float | None] | None = None  # likewise, every run's expert_share (MoE models)
    # CPU seconds this process spent in the timed span (all its threads; child processes not counted):
    # on a shared machine it moves far less than wall time when others take the cores. The median run's,
    # every run's (repeats > 1), and hf-static's median CPU seconds over this system's median.
    cpu_s: float | None = None
    cpu_s_runs: list[float] | None = None
    cpu_ratio_to_hf_static: float | None = None


def step_time_split(steps: Sequence[StepRecord], elapsed: float) -> dict:
    """Fractions of a timed run from the step records the engine core emits: decoder forward (batch
    building and logits included), encoder, sampling; `host_overhead` is the rest — scheduling and
    update inside steps (`scheduler_and_update`) and everything between steps (`outside_steps`:
    detokenizing, the generate loop)."""
    forward = sum(s.forward_duration_s for s in steps)
    encoder = sum(s.encoder_duration_s for s in steps)
    sampling = sum(s.sampling_duration_s for s in steps)
    grammar = sum(s.grammar_duration_s for s in steps)
    in_steps = sum(s.duration_s for s in steps)
    parts = {"forward": forward, "encoder": encoder, "sampling": sampling, "grammar": grammar}
    parts["host_overhead"] = max(0.0, elapsed - forward - encoder - sampling - grammar)
    split = {k: v / elapsed for k, v in parts.items()}
    split["scheduler_and_update"] = max(0.0, in_steps - forward - encoder - sampling - grammar) / elapsed
    split["outside_steps"] = max(0.0, elapsed - in_steps) / elapsed
    return split


def dense_token_rate(
    model: torch.nn.Module, vocab_size: int, num_tokens: int = 2048, repeats: int = 3
) -> float:
    """Tokens/s of one dense forward over `num_tokens` tokens: no engine can process tokens faster."""
    ids = torch.randint(100, vocab_size - 200, (1, num_tokens))
    with torch.inference_mode():
        model(input_ids=ids[:, :64], use_cache=False)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            best = min(best, time.perf_counter() - start)
    return num_tokens / best


# system -> (scheduler policy, encoder chunking). mmserve-no-chunk is vLLM without chunked prefill:
# whole prefills, each media item encoded whole in the step that reaches it. (Encoder chunking alone,
# chunked prefill kept, is `mmserve bench long-video`'s on/off comparison.)
MMSERVE_SYSTEMS = {
    "mmserve": ("fcfs", True),
    "mmserve-no-chunk": ("no_chunk", False),
    "mmserve-static": ("static", True),
    "mmserve-structured": ("fcfs", True),  # mmserve with every request constrained by STRUCTURED_REGEX
}
# JSON-like records, repeated: the grammar accepts after every record, so with ignore_eos (EOS is not
# offered while the grammar allows more) each request still runs to its fixed output length, as the
# unconstrained systems do; the outputs differ from theirs, the token counts do not.
STRUCTURED_REGEX = r'(\{"id": [0-9]{1,4}, "name": "[a-z ]{0,12}", "ok": (true|false)\}, )+'


@dataclass(frozen=True)
class MmserveRun:
    elapsed_s: float
    kv_cache_peak_usage: float
    tokens: list[list[int]]  # per request, in workload order
    step_time_split: dict
    max_num_batched_tokens: int
    arrivals: dict | None = None  # long-video: the arrival driver's latency fields, see _arrival_stats
    expert_share: float | None = None  # MoE models: see SystemResult.expert_share
    cpu_s: float = 0.0  # see SystemResult.cpu_s


class ExpertTimer:
    """Wall time spent inside every `SparseMoE` forward (router, top-k, fused experts) of a model, from
    forward pre/post hooks the bench adds and removes: the model code is not changed. On a GPU each hook
    synchronizes first (otherwise it would time kernel launches), which slows the run it measures a
    little; on the CPU the hooks only read the clock."""

    def __init__(self, model: torch.nn.Module) -> None:
        from mmserve.models.moe import SparseMoE

        self.seconds = 0.0
        self._start = 0.0
        modules = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self.num_modules = len(modules)
        device = next(model.parameters()).device
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._handles = [h for m in modules for h in (
            m.register_forward_pre_hook(self._pre), m.register_forward_hook(self._post)
        )]  # fmt: skip

    def _pre(self, module: torch.nn.Module, args: tuple) -> None:
        self._sync()
        self._start = time.perf_counter()

    def _post(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._start

    def reset(self) -> None:
        self.seconds = 0.0

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _expert_timer(llm: LLM) -> ExpertTimer | None:
    """A timer on the in-process runner's decoder, or None: a dense model (no SparseMoE), or ranks in
    other processes (tensor parallel), whose modules the bench cannot hook."""
    model = llm.engine.executor.local_model()
    if model is None:
        return None
    timer = ExpertTimer(model)
    if timer.num_modules == 0:
        timer.close()
        return None
    return timer


def _make_llm(model_dir: Path, system: str, workload: Workload, c: ThroughputBenchConfig) -> LLM:
    from mmserve import LLM

    policy, chunk_encoder = MMSERVE_SYSTEMS[system]
    budget = c.max_num_batched_tokens or 0
    if policy in ("no_chunk", "static"):  # these refuse a prompt longer than the budget
        budget = max(budget, max(len(p) for p in workload.prompts))
    return LLM(model_dir, scheduler_policy=policy, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=budget,
               max_num_encoder_tokens=c.max_num_encoder_tokens, chunk_encoder=chunk_encoder,
               encoder_token_cost=c.encoder_token_cost)  # fmt: skip


def _engine_prompts(workload: Workload) -> list:
    """What the engine is given per request: the media prompt dict, or the token ids of a text one."""
    if workload.mm_prompts is None:
        return list(workload.prompts)
    return [m if m is not None else p for m, p in zip(workload.mm_prompts, workload.prompts, strict=True)]


def _warm_up(llm: LLM, workload: Workload) -> None:
    """The first and last requests with other content (no prefix- or encoder-cache hits in the timed
    run): text reversed, images inverted, videos cut to 4 inverted frames."""
    from PIL import ImageOps

    from mmserve import SamplingParams

    prompts = _engine_prompts(workload)
    warm = []
    for p in (prompts[0], prompts[-1]):
        if isinstance(p, dict):
            p = {
                "prompt": p["prompt"],
                "images": [ImageOps.invert(im) for im in p.get("images", [])],
                "videos": [255 - v[:4] for v in p.get("videos", [])],
            }
        else:
            p = p[::-1]
        warm.append(p)
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


def run_mmserve(model_dir: Path, workload: Workload, system: str, c: ThroughputBenchConfig) -> MmserveRun:
    """All requests through `LLM.generate` at once, or (long-video) through the arrival driver."""
    from mmserve import SamplingParams
    from mmserve.request import StructuredOutputs

    llm = _make_llm(model_dir, system, workload, c)

    spec = StructuredOutputs(regex=STRUCTURED_REGEX) if system == "mmserve-structured" else None
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, structured_outputs=spec)
        for n in workload.output_lens
    ]
    _warm_up(llm, workload)
    arrivals = None
    timer = _expert_timer(llm)
    llm.step_records.clear()
    cpu_start = time.process_time()
    if workload.arrival_steps is None:
        start = time.perf_counter()
        outputs = llm.generate(_engine_prompts(workload), params)
        elapsed = time.perf_counter() - start
        tokens = [o.token_ids for o in outputs]
    else:
        elapsed, tokens, stamps, first_video_step = _drive_arrivals(llm, workload, params)
    cpu_s = time.process_time() - cpu_start
    if workload.arrival_steps is not None:
        arrivals = _arrival_stats(llm, workload, stamps, first_video_step)
    expert_share = None
    if timer is not None:
        timer.close()
        forward = sum(s.forward_duration_s for s in llm.step_records)
        expert_share = timer.seconds / forward if forward > 0 else None
    stats = llm.stats()
    return MmserveRun(
        elapsed_s=elapsed,
        kv_cache_peak_usage=stats.peak_num_used_blocks / stats.num_total_blocks,
        tokens=tokens,
        step_time_split=step_time_split(list(llm.step_records), elapsed),
        max_num_batched_tokens=llm.engine.scheduler_config.max_num_batched_tokens,
        arrivals=arrivals,
        expert_share=expert_share,
        cpu_s=cpu_s,
    )


def _drive_arrivals(
    llm: LLM, workload: Workload, params: list[SamplingParams]
) -> tuple[float, list[list[int]], list[list[float]], int]:
    """Steps the engine by hand, adding request i after `arrival_steps[i]` steps and stamping each
    output token with the time its step returned. Returns (elapsed, tokens, stamps) per request and
    the index in `llm.step_records` of the first step after the first media request was added.

    Every request is preprocessed before the loop (a server does it off the engine loop, in its decode
    pool, so it must not show as a stall of the decodes); that time still counts in `elapsed`, as it
    does in generate() and in hf-static's image processing."""
    from mmserve.errors import EngineDeadError

    engine, processor = llm.engine, llm.processor
    start = time.perf_counter()
    requests = [
        processor.process(p, sp, f"r{i}")[0]
        for i, (p, sp) in enumerate(zip(_engine_prompts(workload), params, strict=True))
    ]
    order = {r.request_id: i for i, r in enumerate(requests)}
    pending = sorted(zip(workload.arrival_steps or [], requests, strict=True), key=lambda a: a[0])
    pending.reverse()  # popped from the end: earliest arrival last
    tokens: list[list[int]] = [[] for _ in requests]
    stamps: list[list[float]] = [[] for _ in requests]
    step = idle = 0
    first_video_step = None
    while pending or engine.has_unfinished_requests():
        while pending and pending[-1][0] <= step:
            request = pending.pop()[1]
            if first_video_step is None and not workload.is_text(order[request.request_id]):
                first_video_step = len(llm.step_records)
            engine.add_request(request)
        core_outputs = engine.step()
        if core_outputs.step is not None:
            llm.step_records.append(core_outputs.step)
        outputs = core_outputs.outputs
        now = time.perf_counter()
        for out in outputs:
            i = order[out.request_id]
            tokens[i].extend(out.new_token_ids)
            stamps[i].extend([now] * len(out.new_token_ids))
        step += 1
        # Nothing produced, nothing running and nothing left to arrive: nothing ever will (as generate()).
        idle = 0 if outputs or core_outputs.stats.num_running or pending else idle + 1
        if idle > 1:
            raise EngineDeadError("the scheduler admits nothing while no request runs")
    return time.perf_counter() - start, tokens, stamps, first_video_step or 0


def _arrival_stats(llm: LLM, workload: Workload, stamps: list[list[float]], first_video_step: int) -> dict:
    """ITL percentiles of the text requests and the composition and time of every timed step."""
    from mmserve.bench.long_video import step_timeline

    gaps = np.concatenate(
        [np.diff(s) for i, s in enumerate(stamps) if workload.is_text(i) and len(s) > 1] or [np.zeros(0)]
    )  # [num gaps] seconds
    steps = list(llm.step_records)
    times = [s.duration_s for s in steps]
    return {
        "itl_p50_ms": float(np.percentile(gaps, 50)) * 1e3 if len(gaps) else None,
        "itl_p99_ms": float(np.percentile(gaps, 99)) * 1e3 if len(gaps) else None,
        "max_step_s": max(times),
        "median_step_s": float(np.median(times)),
        "max_step_over_median": max(times) / float(np.median(times)),
        "max_step_since_video_s": max(times[first_video_step:] or [0.0]),
        "max_step_since_video_over_median": max(times[first_video_step:] or [0.0]) / float(np.median(times)),
        "max_encoder_tokens_in_a_step": max(s.num_encoder_tokens for s in steps),
        "timeline": step_timeline(steps),
    }


def _run_system(
    system: str, model_dir: Path, hf_model: torch.nn.Module, workload: Workload, c: ThroughputBenchConfig
) -> tuple[float, list[list[int]], MmserveRun | None, float]:
    """One timed run: (elapsed seconds, greedy tokens per request, mmserve's extra figures or None, CPU
    seconds of this process over the timed span)."""
    if system == "hf-static":
        elapsed, tokens, cpu = run_hf_static(hf_model, workload, c.hf_batch_size, 0, model_dir)
        return elapsed, tokens, None, cpu
    if system == "hf-cb":
        elapsed, tokens, cpu = run_hf_cb(hf_model, workload, c.max_num_seqs, c.max_num_batched_tokens or 0)
        return elapsed, tokens, None, cpu
    run = run_mmserve(model_dir, workload, system, c)
    return run.elapsed_s, run.tokens, run, run.cpu_s


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
    # system -> [(elapsed, greedy tokens, mmserve run or None, CPU seconds)], one per repeat
    runs: dict[str, list[tuple[float, list[list[int]], MmserveRun | None, float]]] = {k: [] for k in c.systems}
    with tqdm(total=c.repeats * len(c.systems), desc="bench throughput", disable=not progress) as bar:
        for _ in range(c.repeats):
            rooflines.append(dense_token_rate(hf_model, cfg.vocab_size))
            for system in c.systems:
                runs[system].append(_run_system(system, model_dir, hf_model, workload, c))
                gc.collect()
                bar.update()
    roofline = max(rooflines)  # a ceiling: noise only ever makes a measurement of it lower
    bound = workload.num_output_tokens / (
        (workload.num_prompt_tokens + workload.num_output_tokens) / roofline
    )
    results: dict[str, SystemResult] = {}
    tokens: dict[str, list[list[int]]] = {}
    for system, system_runs in runs.items():
        elapsed, tokens[system], run, _ = sorted(system_runs, key=lambda r: r[0])[(len(system_runs) - 1) // 2]
        cpu_runs = [r[3] for r in system_runs]
        mmserve_fields = {}
        if run is not None:
            mmserve_fields = {
                "kv_cache_peak_usage": run.kv_cache_peak_usage,
                "step_time_split": run.step_time_split,
                "max_num_batched_tokens": run.max_num_batched_tokens,
                "expert_share": run.expert_share,
                **(run.arrivals or {}),
            }
        out_rate = workload.num_output_tokens / elapsed
        results[system] = SystemResult(
            system=system,
            elapsed_s=elapsed,
            requests_per_s=len(workload.prompts) / elapsed,
            output_tokens_per_s=out_rate,
            total_tokens_per_s=(workload.num_prompt_tokens + workload.num_output_tokens) / elapsed,
            efficiency=out_rate / bound,
            **mmserve_fields,
            elapsed_s_runs=[r[0] for r in system_runs] if c.repeats > 1 else None,
            expert_share_runs=[r[2].expert_share for r in system_runs]
            if c.repeats > 1 and run is not None and run.expert_share is not None
            else None,
            cpu_s=sorted(cpu_runs)[(len(cpu_runs) - 1) // 2],
            cpu_s_runs=cpu_runs if c.repeats > 1 else None,
        )
    if "hf-static" in results:
        base, base_cpu = results["hf-static"].output_tokens_per_s, results["hf-static"].cpu_s
        results = {
            k: SystemResult(
                **{
                    **asdict(r),
                    "ratio_to_hf_static": r.output_tokens_per_s / base,
                    "cpu_ratio_to_hf_static": base_cpu / r.cpu_s if r.cpu_s else None,
                }
            )
            for k, r in results.items()
        }
    report = {
        "config": {**asdict(c), "model": str(model_dir), "torch_threads": torch.get_num_threads()},
        "workload": {
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": workload.num_output_tokens,
            "video_tokens": workload.video_tokens,  # placeholder tokens of one video
            # long-video: the driver step after which each video request is added
            "video_arrival_steps": [
                a for i, a in enumerate(workload.arrival_steps or []) if not workload.is_text(i)
            ],
        },
        "roofline_tokens_per_s": roofline,
        "roofline_tokens_per_s_runs": rooflines,
        "output_tokens_per_s_bound": bound,
        "systems": {k: asdict(r) for k, r in results.items()},
        # Greedy outputs of every system should agree; report how many requests differ from the first.
        # With repeats, the worst run of each system counts.
        "outputs_differing_from_first_system": {
            k: max(sum(a != b for a, b in zip(r[1], tokens[c.systems[0]], strict=True)) for r in v)
            for k, v in runs.items()
        },
        **_chunking_cost(results),
        **_structured_cost(results),
    }
    return report


def _structured_cost(results: dict[str, SystemResult]) -> dict:
    """mmserve-structured against mmserve when both ran: the share of its run spent filling bitmasks and
    advancing matchers, and its wall time over the unconstrained run's (same requests, same lengths)."""
    plain, structured = results.get("mmserve"), results.get("mmserve-structured")
    if plain is None or structured is None or structured.step_time_split is None:
        return {}
    return {
        "structured_overhead": {
            "grammar_share_of_run": structured.step_time_split["grammar"],
            "elapsed_over_unconstrained": structured.elapsed_s / plain.elapsed_s,
        }
    }


def _chunking_cost(results: dict[str, SystemResult]) -> dict:
    """mmserve against mmserve-no-chunk when both ran: the tail ITL chunking buys (long-video) and the
    throughput it costs (1 - chunked / unchunked output tokens/s; negative: chunking is faster)."""
    chunk, whole = results.get("mmserve"), results.get("mmserve-no-chunk")
    if chunk is None or whole is None:
        return {}
    cost = {"throughput_cost_of_chunking": 1 - chunk.output_tokens_per_s / whole.output_tokens_per_s}
    if chunk.itl_p99_ms is not None and whole.itl_p99_ms:
        cost["p99_itl_chunk_over_no_chunk"] = chunk.itl_p99_ms / whole.itl_p99_ms
    return cost


def format_report(report: dict) -> str:
    lines = [
        f"roofline {report['roofline_tokens_per_s']:.0f} tok/s (dense forward of 2048 tokens); "
        f"output-token bound {report['output_tokens_per_s_bound']:.1f} tok/s",
        f"{'system':<18}{'req/s':>8}{'out tok/s':>11}{'total tok/s':>13}{'efficiency':>12}{'vs hf-static':>14}"
        f"{'CPU s':>9}{'CPU vs hf':>11}",
    ]
    for r in report["systems"].values():
        ratio = f"{r['ratio_to_hf_static']:.2f}x" if r["ratio_to_hf_static"] is not None else "-"
        cpu_ratio = f"{r['cpu_ratio_to_hf_static']:.2f}x" if r.get("cpu_ratio_to_hf_static") is not None else "-"
        cpu = f"{r['cpu_s']:.1f}" if r.get("cpu_s") is not None else "-"
        lines.append(
            f"{r['system']:<18}{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>11.1f}"
            f"{r['total_tokens_per_s']:>13.1f}{r['efficiency']:>11.0%}{ratio:>14}{cpu:>9}{cpu_ratio:>11}"
        )
    for r in report["systems"].values():
        if r.get("step_time_split"):
            sp = r["step_time_split"]
            experts = f"; experts {r['expert_share']:.0%} of forward" if r.get("expert_share") is not None else ""
            lines.append(
                f"{r['system']}: time split forward {sp['forward']:.0%}, encoder {sp['encoder']:.0%}, "
                f"sampling {sp['sampling']:.0%}, host overhead {sp['host_overhead']:.0%} "
                f"(scheduler+update {sp['scheduler_and_update']:.0%}, "
                f"outside steps {sp['outside_steps']:.0%}); "
                f"KV peak {r['kv_cache_peak_usage']:.1%}"
                + experts
            )
    for r in report["systems"].values():
        if r.get("timeline") is not None:
            itl = (
                f"text ITL p50 {r['itl_p50_ms']:.1f} ms, p99 {r['itl_p99_ms']:.1f} ms"
                if r["itl_p99_ms"] is not None
                else "no text ITL"
            )
            lines.append(
                f"{r['system']}: {itl}; step max {r['max_step_s'] * 1e3:.1f} ms, median "
                f"{r['median_step_s'] * 1e3:.1f} ms (max/median {r['max_step_over_median']:.2f}; since the first "
                f"video arrived max {r['max_step_since_video_s'] * 1e3:.1f} ms, "
                f"{r['max_step_since_video_over_median']:.2f}x median) over {len(r['timeline'])} steps; at most "
                f"{r['max_encoder_tokens_in_a_step']} encoder tokens in a step "
                f"(a video is {report['workload']['video_tokens']}), token budget {r['max_num_batched_tokens']}"
            )
    if report["config"].get("repeats", 1) > 1:
        runs = "; ".join(
            f"{r['system']} " + " / ".join(f"{t:.1f}" for t in r["elapsed_s_runs"])
            for r in report["systems"].values()
        )
        lines.append(
            f"{report['config']['repeats']} runs each, interleaved; the figures above are each system's "
            f"median run. Wall times (s): {runs}; roofline runs (tok/s): "
            + " / ".join(f"{x:.0f}" for x in report["roofline_tokens_per_s_runs"])
        )
        shares = [r for r in report["systems"].values() if r.get("expert_share_runs")]
        if shares:
            lines.append(
                "expert share of forward per run: "
                + "; ".join(f"{r['system']} " + " / ".join(f"{x:.0%}" for x in r["expert_share_runs"]) for r in shares)
            )
    if "p99_itl_chunk_over_no_chunk" in report:
        lines.append(
            f"p99 text ITL, mmserve / mmserve-no-chunk: {report['p99_itl_chunk_over_no_chunk']:.2f}x"
        )
    if "throughput_cost_of_chunking" in report:
        lines.append(
            f"throughput cost of chunking (1 - mmserve / mmserve-no-chunk): {report['throughput_cost_of_chunking']:.1%}"
        )
    return "\n".join(lines)
