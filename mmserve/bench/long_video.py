"""`mmserve bench long-video`: how much one long video's prefill disturbs running text decodes: the step
times (each an inter-token gap of every decode) and the video's TTFT, per step-time target (`--max-step-ms`;
0: fixed token budgets) with encoder chunking on, and once off (the video encoded in one step, as vLLM)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

from mmserve import LLM, SamplingParams
from mmserve.bench import LongVideoBenchConfig, num, summary, table
from mmserve.bench.workload import video_prompt
from mmserve.engine.messages import EngineCoreOutputs, StepRecord


def step_engine(llm: LLM) -> EngineCoreOutputs:
    """One engine step driven by hand (also by `bench throughput --workload long-video`), its record kept in
    `llm.step_records` as generate() keeps them."""
    core_outputs = llm.engine.step()
    if core_outputs.step is not None:
        llm.step_records.append(core_outputs.step)
    return core_outputs


def step_timeline(steps: Iterable[StepRecord]) -> list[dict]:
    """Each step's time and token mix, as the JSON reports and the timeline plot take them (also used by
    `bench throughput --workload long-video`)."""
    return [{"duration_s": s.duration_s, "encoder_duration_s": s.encoder_duration_s,
             "decode_tokens": s.num_decode_tokens, "prefill_tokens": s.num_prefill_tokens,
             "encoder_tokens": s.num_encoder_tokens} for s in steps]  # fmt: skip


def run_once(model_dir: Path, cfg: LongVideoBenchConfig, chunk_encoder: bool,
             max_step_ms: float | None) -> dict:  # fmt: skip
    """`cfg.num_decodes` decodes running, then the video added: every step until its first token."""
    llm = LLM(model_dir, dtype=cfg.dtype, max_num_batched_tokens=cfg.max_num_batched_tokens,
              max_num_encoder_tokens=cfg.max_num_encoder_tokens, chunk_encoder=chunk_encoder,
              encoder_cache_size=1 << 20, max_step_ms=max_step_ms)  # fmt: skip
    llm.generate(video_prompt(4, cfg.frame_size, 1), SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    decode = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    for i in range(cfg.num_decodes):
        prompt = f"Tell story number {i} about a red circle."
        llm.engine.add_request(llm.processor.process(prompt, decode, f"d{i}")[0])
    started: set[str] = set()
    while len(started) < cfg.num_decodes:  # until every decode is past its prefill (the target may slow it)
        started.update(o.request_id for o in llm.engine.step().outputs)
    clip = video_prompt(cfg.num_frames, cfg.frame_size, 2)
    video = llm.processor.process(clip, SamplingParams(max_tokens=1), "video")[0]
    llm.step_records.clear()
    added = time.perf_counter()
    llm.engine.add_request(video)
    while not any(o.request_id == "video" and o.finished for o in step_engine(llm).outputs):
        pass  # the decodes and the video's prefill step on until its first (and only) token
    video_ttft_s = time.perf_counter() - added
    llm.close()  # the decodes, still running, are dropped with it
    steps, times = llm.step_records, [s.duration_s for s in llm.step_records]
    longest, median = max(times), statistics.median(times)
    return {
        "chunk_encoder": chunk_encoder, "max_step_ms": max_step_ms, "video_ttft_s": video_ttft_s,
        "max_over_target": longest / (max_step_ms / 1e3) if max_step_ms else None,
        # One input holding every group (Qwen2/2.5-VL), or one input per group (Qwen3-VL: timestamps between).
        "temporal_groups": sum(mm.num_groups for mm in video.mm_inputs),
        "video_tokens": sum(mm.placeholder.length for mm in video.mm_inputs),
        "steps": len(steps), "max_step_s": longest, "median_step_s": median,
        "max_over_median": longest / median,
        "max_encoder_tokens_in_a_step": max(s.num_encoder_tokens for s in steps),
        "decode_tokens_per_step_min": min(s.num_decode_tokens for s in steps),
        "timeline": step_timeline(steps),  # step composition while the video prefills, for the plot
    }  # fmt: skip


def bench_long_video(model_dir: Path, cfg: LongVideoBenchConfig) -> dict:
    """One chunked run per `max_step_ms` (0: fixed token budgets), then, with `whole`, the video encoded
    whole under the first of them."""
    runs = [(True, m or None) for m in cfg.max_step_ms]
    runs += [(False, cfg.max_step_ms[0] or None)] if cfg.whole else []
    results = [run_once(model_dir, cfg, chunk, step_ms) for chunk, step_ms in runs]
    report = {"config": {**asdict(cfg), "model": str(model_dir)}, "runs": results}
    if cfg.whole:
        report["max_step_ratio_off_over_on"] = results[-1]["max_step_s"] / results[0]["max_step_s"]
    return report


def run_label(run: dict) -> str:
    """'encoder chunking on, max step 250 ms' and the like."""
    step = f"max step {run['max_step_ms']:g} ms" if run.get("max_step_ms") else "fixed budgets"
    return f"encoder chunking {'on' if run['chunk_encoder'] else 'off'}, {step}"


def format_report(report: dict) -> str:
    rows = [(run_label(r), r["temporal_groups"], r["steps"], num(r["max_step_s"] * 1e3),
             num(r["median_step_s"] * 1e3), num(r["max_over_median"], ".2f"),
             num(r["max_over_target"], ".2f"), num(r["video_ttft_s"], ".2f"))
            for r in report["runs"]]  # fmt: skip
    text = table(("run", "groups", "steps", "max step ms", "median ms", "max/median", "max/target",
                  "video TTFT s"), rows)  # fmt: skip
    if (ratio := report.get("max_step_ratio_off_over_on")) is not None:
        text += "\n" + summary([("Max step, encoder chunking off / on:", num(ratio, ".2f"))])
    return text
