"""`mmserve bench long-video`: how much a long video prefill disturbs running decodes. Text requests
decode while a video of many temporal groups arrives; the step times while it prefills (each one an
inter-token gap of every decode: decodes are in every step) and the video's time to first token are
reported for each step-time target (`--max-step-ms`; 0: fixed token budgets) with encoder chunking on
(groups encoded as the prefill reaches them), and once with it off (the whole video encoded in one
step, as vLLM does)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from pathlib import Path

from mmserve import LLM, SamplingParams
from mmserve.bench import LongVideoBenchConfig
from mmserve.bench.workload import video_prompt
from mmserve.engine.messages import StepRecord


def run_once(model_dir: Path, cfg: LongVideoBenchConfig, chunk_encoder: bool, max_step_ms: float | None) -> dict:
    """`cfg.num_decodes` decodes running, then the video added: every step until its first token."""
    llm = LLM(model_dir, dtype=cfg.dtype, max_num_batched_tokens=cfg.max_num_batched_tokens,
              max_num_encoder_tokens=cfg.max_num_encoder_tokens, chunk_encoder=chunk_encoder,
              encoder_cache_size=1 << 20, max_step_ms=max_step_ms)  # fmt: skip
    num_decodes, frame_size = cfg.num_decodes, cfg.frame_size
    engine, processor = llm.engine, llm.processor
    llm.generate([video_prompt(4, frame_size, 1)], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    decode = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    for i in range(num_decodes):
        request, _ = processor.process(f"Tell story number {i} about a red circle.", decode, f"d{i}")
        engine.add_request(request)
    for _ in range(4):  # all decodes running
        engine.step()
    video, _ = processor.process(
        video_prompt(cfg.num_frames, frame_size, 2), SamplingParams(max_tokens=1), "video"
    )
    # One input holding every group (Qwen2/2.5-VL), or one input per group (Qwen3-VL: timestamps between them).
    num_groups = sum(mm.num_groups for mm in video.mm_inputs)
    video_tokens = sum(mm.placeholder.length for mm in video.mm_inputs)
    added = time.perf_counter()
    engine.add_request(video)
    steps: list[StepRecord] = []
    while True:
        step = engine.step()
        if step.step is not None:
            steps.append(step.step)
        if any(o.request_id == "video" and o.finished for o in step.outputs):
            break
    video_ttft_s = time.perf_counter() - added
    engine.abort_requests([f"d{i}" for i in range(num_decodes)])
    llm.close()
    times = [s.duration_s for s in steps]
    return {
        "chunk_encoder": chunk_encoder,
        "max_step_ms": max_step_ms,
        "video_ttft_s": video_ttft_s,
        "max_over_target": max(times) / (max_step_ms / 1e3) if max_step_ms else None,
        "temporal_groups": num_groups,
        "video_tokens": video_tokens,
        "steps": len(steps),
        "max_step_s": max(times),
        "median_step_s": statistics.median(times),
        "max_over_median": max(times) / statistics.median(times),
        "max_encoder_tokens_in_a_step": max(s.num_encoder_tokens for s in steps),
        "decode_tokens_per_step_min": min(s.num_decode_tokens for s in steps),
        "timeline": step_timeline(steps),  # step composition while the video prefills, for the plot
    }


def step_timeline(steps: list[StepRecord]) -> list[dict]:
    """Each step's time and token mix, as the JSON reports and the timeline plot take them (also used
    by `bench throughput --workload long-video`)."""
    return [
        {
            "duration_s": s.duration_s,
            "encoder_duration_s": s.encoder_duration_s,
            "decode_tokens": s.num_decode_tokens,
            "prefill_tokens": s.num_prefill_tokens,
            "encoder_tokens": s.num_encoder_tokens,
        }
        for s in steps
    ]


def bench_long_video(model_dir: Path, cfg: LongVideoBenchConfig) -> dict:
    """One chunked run per `max_step_ms` (0: fixed token budgets), then, with `whole`, the video encoded
    whole under the first of them."""
    first = cfg.max_step_ms[0] or None
    runs = [(True, m or None) for m in cfg.max_step_ms] + ([(False, first)] if cfg.whole else [])
    results = [run_once(model_dir, cfg, chunk, step_ms) for chunk, step_ms in runs]
    report = {
        "config": {**asdict(cfg), "model": str(model_dir)},
        "runs": results,
    }
    if cfg.whole:
        report["max_step_ratio_off_over_on"] = results[-1]["max_step_s"] / results[0]["max_step_s"]
    return report


def run_label(run: dict) -> str:
    """'encoder chunking on, max step 250 ms' and the like."""
    step = f"max step {run['max_step_ms']:g} ms" if run.get("max_step_ms") else "fixed budgets"
    return f"encoder chunking {'on' if run['chunk_encoder'] else 'off'}, {step}"


def format_report(report: dict) -> str:
    lines = [
        f"{'run':<42}{'groups':>7}{'steps':>7}{'max step ms':>13}{'median ms':>11}{'max/median':>12}"
        f"{'video TTFT s':>14}"
    ]
    for r in report["runs"]:
        lines.append(
            f"{run_label(r):<42}{r['temporal_groups']:>7}{r['steps']:>7}{r['max_step_s'] * 1e3:>13.1f}"
            f"{r['median_step_s'] * 1e3:>11.1f}{r['max_over_median']:>12.2f}{r['video_ttft_s']:>14.2f}"
        )
    if "max_step_ratio_off_over_on" in report:
        lines.append(f"max step, encoder chunking off / on: {report['max_step_ratio_off_over_on']:.2f}x")
    return "\n".join(lines)
