"""`mmserve bench throughput`: offline throughput of several systems on exactly the same requests,
measured in one process, with every figure also set against the model's dense-forward roofline."""

from __future__ import annotations

import gc
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmserve.bench import SYSTEMS, WORKLOADS

if TYPE_CHECKING:
    from mmserve import LLM, SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids as the engine sees them (media placeholders expanded)
    output_lens: list[int]
    # random-mm / long-video: per request the chat-templated text with placeholders and its images (PIL)
    # and videos ([T, H, W, 3] uint8), or None for a text request (the engine gets its `prompts` ids);
    # transformers gets `prompts` plus pixels from its own image processor (videos: mmserve's, see
    # _hf_media_kwargs).
    mm_prompts: list[dict | None] | None = None
    # long-video: the driver step after which each request is added (None: all at once, as generate()).
    arrival_steps: list[int] | None = None
    video_tokens: int = 0  # placeholder tokens of one video (0: no videos)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def is_text(self, i: int) -> bool:
        return self.mm_prompts is None or self.mm_prompts[i] is None


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
    # mmserve only: fractions of the timed run (forward, encoder, sampling, host overhead), see StepTimer
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
    # With repeats > 1: every run's wall time, in run order; the other figures are the median run's.
    elapsed_s_runs: list[float] | None = None


def random_workload(
    vocab_size: int, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0
) -> Workload:
    rng = random.Random(seed)
    # Ids well inside the vocabulary, away from the special tokens at its end.
    prompts = [
        [rng.randrange(100, vocab_size - 200) for _ in range(rng.randint(*input_len))]
        for _ in range(num_prompts)
    ]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_prompts)])


def prefix_workload(
    vocab_size: int,
    num_prompts: int,
    prefix_len: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
) -> Workload:
    """Every prompt starts with the same `prefix_len` tokens, then a random suffix (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab_size - 200) for _ in range(prefix_len)]
    base = random_workload(vocab_size, num_prompts, input_len, output_len, seed + 1)
    return Workload([prefix + p for p in base.prompts], base.output_lens)


def _template(body: str) -> str:
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"{body}<|im_end|>\n<|im_start|>assistant\n"
    )


_IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
_VIDEO_MARK = "<|vision_start|><|video_pad|><|vision_end|>"
FIRST_VIDEO_STEP = 4  # long-video: steps after the text prefills before the first video arrives
VIDEO_OUTPUT_LEN = 8  # long-video: tokens each video request generates (a short answer)


def _random_frames(np_rng: np.random.Generator, num_frames: int, size: int) -> np.ndarray:
    return np_rng.integers(0, 255, (num_frames, size, size, 3), dtype=np.uint8)  # [T, H, W, 3]


def _expand(model_dir: Path, prompts: list) -> tuple[list[list[int]], int]:
    """The engine's token ids of each prompt (placeholders expanded by mmserve's own processor; nothing
    runs, the KV pool is only big enough that the model's own context limit applies), and the
    placeholder length of the last video seen (0: none)."""
    from mmserve import LLM, SamplingParams

    processor = LLM(model_dir, num_kv_blocks=4096).processor
    ids, video_tokens = [], 0
    for i, p in enumerate(prompts):
        request = processor.process(p, SamplingParams(max_tokens=1), f"w{i}")[0]
        ids.append(request.prompt_token_ids)
        video_tokens = next(
            (m.placeholder.length for m in request.mm_inputs if m.modality == "video"), video_tokens
        )
    return ids, video_tokens


def random_mm_workload(
    model_dir: Path,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    num_images: int = 1,
    image_size: int = 64,
    seed: int = 0,
    num_frames: int = 0,
    video_size: int = 112,
) -> Workload:
    """Each prompt: `num_images` random images of `image_size`^2 pixels, then (num_frames > 0) one video
    of `num_frames` random `video_size`^2 frames, all distinct (no cache hits), and a random text."""
    from PIL import Image

    if num_images < 0 or num_frames < 0 or num_images + num_frames == 0:
        raise ValueError("random-mm needs images (--num-images) or a video (--num-frames), none negative")
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    words = "red blue green circle square shape image count colour left right top bottom".split()
    mm_prompts: list[dict | None] = []
    for _ in range(num_prompts):
        images = [
            Image.fromarray(np_rng.integers(0, 255, (image_size, image_size, 3), dtype=np.uint8))
            for _ in range(num_images)
        ]
        videos = [_random_frames(np_rng, num_frames, video_size)] if num_frames else []
        text = " ".join(rng.choice(words) for _ in range(rng.randint(*input_len)))
        marks = _IMAGE_MARK * num_images + _VIDEO_MARK * len(videos)
        mm_prompts.append({"prompt": _template(marks + text), "images": images, "videos": videos})
    ids, video_tokens = _expand(model_dir, mm_prompts)
    out_lens = [rng.randint(*output_len) for _ in range(num_prompts)]
    return Workload(ids, out_lens, mm_prompts, video_tokens=video_tokens)


def long_video_workload(
    model_dir: Path,
    vocab_size: int,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    num_videos: int,
    num_frames: int,
    video_size: int,
    interval_steps: int,
    max_num_batched_tokens: int,
    max_num_encoder_tokens: int,
    seed: int = 0,
) -> Workload:
    """`num_prompts` random text requests added at once, then `num_videos` video requests (one random
    video and a short question each) added one every `interval_steps` driver steps, the first
    FIRST_VIDEO_STEP steps after the text prompts could have prefilled at the token budget. The
    schedule counts steps, not seconds, so every mmserve system sees the same arrivals.

    Text outputs are the random lengths plus enough steps to outlast every video's chunked prefill
    (budget left beside the decodes, or the encoder budget, whichever is smaller), so the videos
    always arrive into a steady set of decodes."""
    if num_videos < 1 or num_frames < 1 or interval_steps < 1:
        raise ValueError("long-video needs --num-videos, --num-frames and --video-interval-steps >= 1")
    text = random_workload(vocab_size, num_prompts, input_len, output_len, seed)
    np_rng = np.random.default_rng(seed + 1)
    videos = [
        {
            "prompt": _template(_VIDEO_MARK + f"What happens in clip {j}?"),
            "videos": [_random_frames(np_rng, num_frames, video_size)],
        }
        for j in range(num_videos)
    ]
    video_ids, video_tokens = _expand(model_dir, videos)
    first = -(-text.num_prompt_tokens // max_num_batched_tokens) + FIRST_VIDEO_STEP
    arrivals = [first + j * interval_steps for j in range(num_videos)]
    per_step = max(1, min(max_num_batched_tokens - num_prompts, max_num_encoder_tokens))
    prefill_steps = sum(-(-len(p) // per_step) for p in video_ids)
    cover = arrivals[-1] + prefill_steps + VIDEO_OUTPUT_LEN
    return Workload(
        prompts=text.prompts + video_ids,
        output_lens=[n + cover for n in text.output_lens] + [VIDEO_OUTPUT_LEN] * num_videos,
        mm_prompts=[None] * num_prompts + videos,
        arrival_steps=[0] * num_prompts + arrivals,
        video_tokens=video_tokens,
    )


class StepTimer:
    """Times the engine from outside (wrapping instance attributes, no engine edits): step, execute,
    model forward + logits, sampler, and the runner's own encoder timer. CPU timings: on CUDA the
    wrappers would need a sync to be exact."""

    def __init__(self, llm: object) -> None:
        self.t = {"step": 0.0, "execute": 0.0, "forward": 0.0, "sampling": 0.0, "encoder": 0.0}
        engine = llm.engine  # type: ignore[attr-defined]
        runner = engine.runner
        model = runner.model
        self._restore = [
            (engine, "step", engine.step),
            (runner, "execute", runner.execute),
            (model, "forward", model.forward),
            (model, "compute_logits", model.compute_logits),
            (runner, "sampler", runner.sampler),
        ]
        engine.step = self._timed(engine.step, "step")
        model.forward = self._timed(model.forward, "forward")
        model.compute_logits = self._timed(model.compute_logits, "forward")
        runner.sampler = self._timed(runner.sampler, "sampling")
        execute = self._timed(runner.execute, "execute")

        def execute_and_encoder(plan: object) -> object:
            out = execute(plan)
            self.t["encoder"] += runner.last_encoder_duration_s
            return out

        runner.execute = execute_and_encoder

    def _timed(self, fn, key: str):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.t[key] += time.perf_counter() - start

        return wrapper

    def remove(self) -> None:
        for obj, name, original in self._restore:
            if name == "sampler":
                setattr(obj, name, original)
            else:
                vars(obj).pop(name)  # the class's method shows through again

    def split(self, elapsed: float) -> dict:
        """Fractions of the timed run; `host_overhead` is everything else (scheduling, batch building,
        host copies, detokenizing, the generate loop)."""
        t = self.t
        parts = {"forward": t["forward"], "encoder": t["encoder"], "sampling": t["sampling"]}
        parts["host_overhead"] = max(0.0, elapsed - sum(parts.values()))
        split = {k: v / elapsed for k, v in parts.items()}
        split["inside_runner_other"] = (
            max(0.0, t["execute"] - t["forward"] - t["encoder"] - t["sampling"]) / elapsed
        )
        split["scheduler_and_update"] = max(0.0, t["step"] - t["execute"]) / elapsed
        split["outside_steps"] = max(0.0, elapsed - t["step"]) / elapsed
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
# whole prefills, each media item encoded whole in the step that reaches it.
MMSERVE_SYSTEMS = {
    "mmserve": ("fcfs", True),
    "mmserve-no-chunk": ("no_chunk", False),
    "mmserve-static": ("static", True),
}


@dataclass(frozen=True)
class MmserveRun:
    elapsed_s: float
    kv_cache_peak_usage: float
    tokens: list[list[int]]  # per request, in workload order
    step_time_split: dict
    max_num_batched_tokens: int
    arrivals: dict | None = None  # long-video: the arrival driver's latency fields, see _arrival_stats


def _make_llm(
    model_dir: Path,
    system: str,
    workload: Workload,
    max_num_seqs: int,
    budget: int,
    encoder_budget: int | None,
) -> LLM:
    from mmserve import LLM

    policy, chunk_encoder = MMSERVE_SYSTEMS[system]
    if policy in ("no_chunk", "static"):  # these refuse a prompt longer than the budget
        budget = max(budget, max(len(p) for p in workload.prompts))
    return LLM(
        model_dir,
        scheduler_policy=policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_num_encoder_tokens=encoder_budget,
        chunk_encoder=chunk_encoder,
    )


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


def run_mmserve(
    model_dir: Path,
    workload: Workload,
    system: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_num_encoder_tokens: int | None = None,
) -> MmserveRun:
    """All requests through `LLM.generate` at once, or (long-video) through the arrival driver."""
    from mmserve import SamplingParams

    llm = _make_llm(model_dir, system, workload, max_num_seqs, max_num_batched_tokens, max_num_encoder_tokens)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    _warm_up(llm, workload)
    arrivals = None
    timer = StepTimer(llm)
    if workload.arrival_steps is None:
        start = time.perf_counter()
        outputs = llm.generate(_engine_prompts(workload), params)
        elapsed = time.perf_counter() - start
        tokens = [o.token_ids for o in outputs]
    else:
        elapsed, tokens, stamps = _drive_arrivals(llm, workload, params)
        arrivals = _arrival_stats(llm, workload, stamps)
    timer.remove()
    stats = llm.stats()
    return MmserveRun(
        elapsed_s=elapsed,
        kv_cache_peak_usage=stats.peak_num_used_blocks / stats.num_total_blocks,
        tokens=tokens,
        step_time_split=timer.split(elapsed),
        max_num_batched_tokens=llm.engine.scheduler_config.max_num_batched_tokens,
        arrivals=arrivals,
    )


def _drive_arrivals(
    llm: LLM, workload: Workload, params: list[SamplingParams]
) -> tuple[float, list[list[int]], list[list[float]]]:
    """Steps the engine by hand, adding request i after `arrival_steps[i]` steps and stamping each
    output token with the time its step returned. Returns (elapsed, tokens, stamps) per request.

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
    engine.step_history.clear()
    step = idle = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[-1][0] <= step:
            engine.add_request(pending.pop()[1])
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            i = order[out.request_id]
            tokens[i].extend(out.new_token_ids)
            stamps[i].extend([now] * len(out.new_token_ids))
        step += 1
        # Nothing produced, nothing running and nothing left to arrive: nothing ever will (as generate()).
        idle = 0 if outputs or engine.scheduler.running or pending else idle + 1
        if idle > 1:
            raise EngineDeadError("the scheduler admits nothing while no request runs")
    return time.perf_counter() - start, tokens, stamps


def _arrival_stats(llm: LLM, workload: Workload, stamps: list[list[float]]) -> dict:
    """ITL percentiles of the text requests and the composition and time of every timed step."""
    from mmserve.bench.long_video import step_timeline

    gaps = np.concatenate(
        [np.diff(s) for i, s in enumerate(stamps) if workload.is_text(i) and len(s) > 1] or [np.zeros(0)]
    )  # [num gaps] seconds
    steps = list(llm.engine.step_history)
    times = [s.duration_s for s in steps]
    return {
        "itl_p50_ms": float(np.percentile(gaps, 50)) * 1e3 if len(gaps) else None,
        "itl_p99_ms": float(np.percentile(gaps, 99)) * 1e3 if len(gaps) else None,
        "max_step_s": max(times),
        "median_step_s": float(np.median(times)),
        "max_encoder_tokens_in_a_step": max(s.num_encoder_tokens for s in steps),
        "timeline": step_timeline(steps),
    }


def _hf_media_kwargs(
    model: torch.nn.Module, model_dir: Path, workload: Workload, idx: list[int], ids: torch.Tensor
) -> dict:
    """Media inputs of the batch's requests, in order: images through transformers' own image processor;
    videos through mmserve's frame-by-frame preprocessing (transformers' video processor needs
    torchvision), as tests/test_mm_parity.py. Token types mark image (1) and video (2) placeholders."""
    if workload.mm_prompts is None:
        return {}
    prompts = [workload.mm_prompts[i] for i in idx if workload.mm_prompts[i] is not None]
    images = [im for p in prompts for im in p.get("images", [])]
    videos = [v for p in prompts for v in p.get("videos", [])]
    if not images and not videos:
        return {}
    cfg = model.config
    kwargs = {
        "mm_token_type_ids": (ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long()
    }
    if images:
        from transformers import AutoImageProcessor

        px = AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")
        kwargs.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
    if videos:
        from mmserve.encoders.media import DEFAULT_LIMITS
        from mmserve.encoders.preprocess import load_preprocess_config, preprocess_video

        vcfg = load_preprocess_config(model_dir, "video")
        processed = [preprocess_video(v, vcfg) for v in videos]
        kwargs.update(
            pixel_values_videos=torch.cat([p.pixel_values for p in processed]),
            video_grid_thw=torch.tensor([p.grid_thw for p in processed]),
        )
        if cfg.model_type == "qwen2_5_vl":  # arrays are taken at the default sampling rate, as mmserve
            kwargs["second_per_grid_ts"] = torch.tensor(
                [vcfg.temporal_patch_size / DEFAULT_LIMITS.video_fps] * len(processed)
            )
    return kwargs


def run_hf_static(
    model: torch.nn.Module, workload: Workload, batch_size: int, pad_id: int, model_dir: Path | None = None
) -> tuple[float, list[list[int]]]:
    """transformers generate() in fixed batches, left padded, each batch running to its longest request.

    long-video: the batches follow arrival order (workload order: the texts, then the videos), but the
    arrival steps do not apply: a static batch takes no request once it runs, so a video simply waits
    for the batch before it, and no ITL is reported."""
    order = list(range(len(workload.prompts)))
    results: list[list[int]] = [[] for _ in order]
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(workload.prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = workload.prompts[i]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        max_new = max(workload.output_lens[i] for i in idx)
        media = _hf_media_kwargs(model, model_dir, workload, idx, ids) if model_dir else {}
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                **media,
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_id,
            )
        for row, i in enumerate(idx):
            results[i] = out[row, width : width + workload.output_lens[i]].tolist()
    return time.perf_counter() - start, results


def run_hf_cb(
    model: torch.nn.Module, workload: Workload, max_num_seqs: int, max_num_batched_tokens: int
) -> tuple[float, list[list[int]]]:
    """transformers' own continuous batching (`generate_batch`, paged cache), text only. Its KV pool is
    sized to the workload (its default sizes itself to most of the free memory, slowly, on a CPU)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if workload.mm_prompts is not None:
        raise ValueError("hf-cb runs text workloads only")
    page = 16
    cb = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=sum(
            -(-(len(p) + n) // page) for p, n in zip(workload.prompts, workload.output_lens, strict=True)
        )
        + 16,
        max_batch_tokens=max_num_batched_tokens,
        max_requests_per_batch=max_num_seqs,
    )

    def gen(prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
        # generate_batch has one max_new_tokens for all; its manager takes one per request, as here.
        config = GenerationConfig(
            max_new_tokens=max(max_new), do_sample=False, eos_token_id=-1, pad_token_id=0
        )
        results: dict[str, list[int]] = {}
        with (
            torch.inference_mode(),
            model.continuous_batching_context_manager(
                generation_config=config, continuous_batching_config=cb, block=True, timeout=5, warmup=False
            ) as manager,
        ):
            for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
            while len(results) < len(prompts):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = list(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread died")
        return [results[f"r{i}"] for i in range(len(prompts))]

    gen([p[::-1] for p in workload.prompts[:2]], [2, 2])  # warm-up
    start = time.perf_counter()
    tokens = gen(workload.prompts, workload.output_lens)
    return time.perf_counter() - start, tokens


def load_hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    auto = (
        AutoModelForCausalLM
        if AutoConfig.from_pretrained(model_dir).model_type == "qwen2"
        else AutoModelForImageTextToText
    )
    return auto.from_pretrained(model_dir, dtype=torch.float32).eval()


def _run_system(
    system: str,
    model_dir: Path,
    hf_model: torch.nn.Module,
    workload: Workload,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_num_encoder_tokens: int | None,
    hf_batch_size: int,
) -> tuple[float, list[list[int]], MmserveRun | None]:
    """One timed run: (elapsed seconds, greedy tokens per request, mmserve's extra figures or None)."""
    if system == "hf-static":
        return (*run_hf_static(hf_model, workload, hf_batch_size, 0, model_dir), None)
    if system == "hf-cb":
        return (*run_hf_cb(hf_model, workload, max_num_seqs, max_num_batched_tokens), None)
    run = run_mmserve(
        model_dir, workload, system, max_num_seqs, max_num_batched_tokens, max_num_encoder_tokens
    )
    return run.elapsed_s, run.tokens, run


def bench_throughput(
    model_dir: Path,
    systems: list[str],
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    hf_batch_size: int = 16,
    seed: int = 0,
    json_path: Path | None = None,
    workload_name: str = "random",
    num_images: int = 1,
    image_size: int = 64,
    prefix_len: int = 512,
    progress: bool = False,
    num_frames: int = 0,
    video_size: int = 112,
    num_videos: int = 2,
    video_interval_steps: int = 8,
    max_num_encoder_tokens: int | None = None,
    repeats: int = 1,
) -> dict:
    """Every system on the same workload, `repeats` times round-robin (so drift on a shared machine
    hits every system alike); each system reports its median run, the roofline its best measurement."""
    from tqdm import tqdm

    from mmserve.models.config import DecoderConfig

    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if workload_name not in WORKLOADS:
        raise ValueError(f"unknown workload {workload_name!r}; choose from {WORKLOADS}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if workload_name in ("random-mm", "long-video") and "hf-cb" in systems:
        raise ValueError("hf-cb runs text workloads only (random, prefix)")
    cfg, _ = DecoderConfig.from_pretrained(model_dir)
    if workload_name == "random":
        workload = random_workload(cfg.vocab_size, num_prompts, input_len, output_len, seed)
    elif workload_name == "prefix":
        workload = prefix_workload(cfg.vocab_size, num_prompts, prefix_len, input_len, output_len, seed)
    elif workload_name == "random-mm":
        workload = random_mm_workload(
            model_dir,
            num_prompts,
            input_len,
            output_len,
            num_images,
            image_size,
            seed,
            num_frames,
            video_size,
        )
    else:
        workload = long_video_workload(
            model_dir, cfg.vocab_size, num_prompts, input_len, output_len, num_videos, num_frames,
            video_size, video_interval_steps, max_num_batched_tokens,
            max_num_encoder_tokens or max_num_batched_tokens, seed,
        )  # fmt: skip
    hf_model = load_hf_model(model_dir)
    rooflines: list[float] = []
    # system -> [(elapsed, greedy tokens, mmserve run or None)], one per repeat
    runs: dict[str, list[tuple[float, list[list[int]], MmserveRun | None]]] = {k: [] for k in systems}
    with tqdm(total=repeats * len(systems), desc="bench throughput", disable=not progress) as bar:
        for _ in range(repeats):
            rooflines.append(dense_token_rate(hf_model, cfg.vocab_size))
            for system in systems:
                run = _run_system(
                    system, model_dir, hf_model, workload, max_num_seqs, max_num_batched_tokens,
                    max_num_encoder_tokens, hf_batch_size,
                )  # fmt: skip
                runs[system].append(run)
                gc.collect()
                bar.update()
    roofline = max(rooflines)  # a ceiling: noise only ever makes a measurement of it lower
    bound = workload.num_output_tokens / (
        (workload.num_prompt_tokens + workload.num_output_tokens) / roofline
    )
    results: dict[str, SystemResult] = {}
    tokens: dict[str, list[list[int]]] = {}
    for system, system_runs in runs.items():
        elapsed, tokens[system], run = sorted(system_runs, key=lambda r: r[0])[(len(system_runs) - 1) // 2]
        mmserve_fields = {}
        if run is not None:
            mmserve_fields = {
                "kv_cache_peak_usage": run.kv_cache_peak_usage,
                "step_time_split": run.step_time_split,
                "max_num_batched_tokens": run.max_num_batched_tokens,
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
            elapsed_s_runs=[r[0] for r in system_runs] if repeats > 1 else None,
        )
    if "hf-static" in results:
        base = results["hf-static"].output_tokens_per_s
        results = {
            k: SystemResult(**{**asdict(r), "ratio_to_hf_static": r.output_tokens_per_s / base})
            for k, r in results.items()
        }
    report = {
        "config": {
            "model": str(model_dir),
            "systems": systems,
            "workload": workload_name,
            "num_images": num_images if workload_name == "random-mm" else 0,
            "image_size": image_size if workload_name == "random-mm" else None,
            "num_frames": num_frames if workload_name in ("random-mm", "long-video") else 0,
            "video_size": video_size if workload.video_tokens else None,
            "num_videos": num_videos if workload_name == "long-video" else None,
            "video_interval_steps": video_interval_steps if workload_name == "long-video" else None,
            "prefix_len": prefix_len if workload_name == "prefix" else None,
            "num_prompts": num_prompts,
            "input_len": input_len,
            "output_len": output_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_encoder_tokens": max_num_encoder_tokens,
            "hf_batch_size": hf_batch_size,
            "seed": seed,
            "repeats": repeats,
            "torch_threads": torch.get_num_threads(),
        },
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
            k: max(sum(a != b for a, b in zip(r[1], tokens[systems[0]], strict=True)) for r in v)
            for k, v in runs.items()
        },
        **_chunking_cost(results),
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
    return report


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
        f"{'system':<18}{'req/s':>8}{'out tok/s':>11}{'total tok/s':>13}{'efficiency':>12}{'vs hf-static':>14}",
    ]
    for r in report["systems"].values():
        ratio = f"{r['ratio_to_hf_static']:.2f}x" if r["ratio_to_hf_static"] is not None else "-"
        lines.append(
            f"{r['system']:<18}{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>11.1f}"
            f"{r['total_tokens_per_s']:>13.1f}{r['efficiency']:>11.0%}{ratio:>14}"
        )
    for r in report["systems"].values():
        if r.get("step_time_split"):
            sp = r["step_time_split"]
            lines.append(
                f"{r['system']}: time split forward {sp['forward']:.0%}, encoder {sp['encoder']:.0%}, "
                f"sampling {sp['sampling']:.0%}, host overhead {sp['host_overhead']:.0%} "
                f"(scheduler+update {sp['scheduler_and_update']:.0%}, runner other "
                f"{sp['inside_runner_other']:.0%}, outside steps {sp['outside_steps']:.0%}); "
                f"KV peak {r['kv_cache_peak_usage']:.1%}"
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
                f"{r['median_step_s'] * 1e3:.1f} ms over {len(r['timeline'])} steps; at most "
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
    if "p99_itl_chunk_over_no_chunk" in report:
        lines.append(
            f"p99 text ITL, mmserve / mmserve-no-chunk: {report['p99_itl_chunk_over_no_chunk']:.2f}x"
        )
    if "throughput_cost_of_chunking" in report:
        lines.append(
            f"throughput cost of chunking (1 - mmserve / mmserve-no-chunk): {report['throughput_cost_of_chunking']:.1%}"
        )
    return "\n".join(lines)
