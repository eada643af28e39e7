"""`mmserve bench long-video`: how much a long video prefill disturbs running decodes. Sixteen text
requests decode while a video of many temporal groups arrives; the step times while they run are
reported with encoder chunking on (groups encoded as the prefill reaches them, under an encoder
budget) and off (the whole video encoded in one step, as vLLM does)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from mmserve import LLM, SamplingParams
from mmserve.engine.messages import StepRecord


def _video_prompt(num_frames: int, size: int, seed: int) -> dict:
    frames = np.random.default_rng(seed).integers(0, 255, (num_frames, size, size, 3), dtype=np.uint8)
    return {"prompt": "<|vision_start|><|video_pad|><|vision_end|>Describe the video.", "videos": [frames]}


def run_once(
    model_dir: Path,
    chunk_encoder: bool,
    num_decodes: int,
    num_frames: int,
    frame_size: int,
    max_num_batched_tokens: int,
    max_num_encoder_tokens: int,
) -> dict:
    llm = LLM(
        model_dir,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_encoder_tokens=max_num_encoder_tokens,
        chunk_encoder=chunk_encoder,
        encoder_cache_size=1 << 20,
    )
    engine, processor = llm.engine, llm.processor
    llm.generate([_video_prompt(4, frame_size, 1)], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    decode = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    for i in range(num_decodes):
        request, _ = processor.process(f"Tell story number {i} about a red circle.", decode, f"d{i}")
        engine.add_request(request)
    for _ in range(4):  # all decodes running
        engine.step()
    video, _ = processor.process(
        _video_prompt(num_frames, frame_size, 2), SamplingParams(max_tokens=1), "video"
    )
    # One input holding every group (Qwen2/2.5-VL), or one input per group (Qwen3-VL: timestamps between them).
    num_groups = sum(mm.num_groups for mm in video.mm_inputs)
    video_tokens = sum(mm.placeholder.length for mm in video.mm_inputs)
    engine.add_request(video)
    steps: list[StepRecord] = []
    while True:
        step = engine.step()
        if step.step is not None:
            steps.append(step.step)
        if any(o.request_id == "video" and o.finished for o in step.outputs):
            break
    engine.abort_requests([f"d{i}" for i in range(num_decodes)])
    times = [s.duration_s for s in steps]
    return {
        "chunk_encoder": chunk_encoder,
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


def bench_long_video(
    model_dir: Path,
    num_decodes: int = 16,
    num_frames: int = 64,
    frame_size: int = 224,
    max_num_batched_tokens: int = 512,
    max_num_encoder_tokens: int = 128,
    json_path: Path | None = None,
) -> dict:
    results = [
        run_once(
            model_dir,
            chunk,
            num_decodes,
            num_frames,
            frame_size,
            max_num_batched_tokens,
            max_num_encoder_tokens,
        )
        for chunk in (True, False)
    ]
    report = {
        "config": {
            "model": str(model_dir),
            "num_decodes": num_decodes,
            "num_frames": num_frames,
            "frame_size": frame_size,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_encoder_tokens": max_num_encoder_tokens,
        },
        "runs": results,
        "max_step_ratio_off_over_on": results[1]["max_step_s"] / results[0]["max_step_s"],
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
    return report


def format_report(report: dict) -> str:
    lines = [
        f"{'encoder chunking':<18}{'groups':>7}{'steps':>7}{'max step ms':>13}{'median ms':>11}{'max/median':>12}"
    ]
    for r in report["runs"]:
        lines.append(
            f"{'on' if r['chunk_encoder'] else 'off':<18}{r['temporal_groups']:>7}{r['steps']:>7}"
            f"{r['max_step_s'] * 1e3:>13.1f}{r['median_step_s'] * 1e3:>11.1f}{r['max_over_median']:>12.2f}"
        )
    lines.append(f"max step, off / on: {report['max_step_ratio_off_over_on']:.2f}x")
    return "\n".join(lines)
