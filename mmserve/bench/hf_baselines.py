"""The transformers baselines of `mmserve bench throughput`: `generate()` in fixed, left-padded batches
(hf-static) and transformers' own continuous batching (hf-cb), on a workload's exact token ids."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from mmserve.bench import ThroughputBenchConfig
from mmserve.bench.machine import timed
from mmserve.bench.workload import Workload


def _hf_media_kwargs(model: torch.nn.Module, model_dir: Path, prompts: list[dict | None],
                     ids: torch.Tensor) -> dict:  # fmt: skip
    """Media inputs of a batch's media prompts (None: a text request), in order: images through transformers'
    own image processor; videos through mmserve's frame-by-frame preprocessing (transformers' video processor
    needs torchvision), as tests/test_mm_parity.py. Token types mark image (1) and video (2) placeholders."""
    images = [im for p in prompts if p is not None for im in p.get("images", [])]
    videos = [v for p in prompts if p is not None for v in p.get("videos", [])]
    if not images and not videos:
        return {}
    cfg = model.config
    is_image, is_video = (ids == cfg.image_token_id).long(), (ids == cfg.video_token_id).long()
    kwargs = {"mm_token_type_ids": is_image + 2 * is_video}
    if images:
        from transformers import AutoImageProcessor

        px = AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")
        kwargs.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
    if videos:
        from mmserve.encoders.media import DEFAULT_LIMITS
        from mmserve.encoders.preprocess import load_preprocess_configs, preprocess_video

        vcfg = load_preprocess_configs(model_dir, cfg.model_type)[1]  # family defaults, as mmserve's
        processed = [preprocess_video(v, vcfg) for v in videos]
        kwargs.update(pixel_values_videos=torch.cat([p.pixel_values for p in processed]),
                      video_grid_thw=torch.tensor([p.grid_thw for p in processed]))  # fmt: skip
        if cfg.model_type == "qwen2_5_vl":  # arrays are taken at the default sampling rate, as mmserve
            seconds = vcfg.temporal_patch_size / DEFAULT_LIMITS.video_fps
            kwargs["second_per_grid_ts"] = torch.tensor([seconds] * len(processed))
    return kwargs


def run_hf_static(model: torch.nn.Module, model_dir: Path, workload: Workload,
                  c: ThroughputBenchConfig) -> tuple[float, list[list[int]], float]:  # fmt: skip
    """transformers generate() in batches of `c.hf_batch_size`, left padded (with token 0), each running to
    its longest request. Returns (wall seconds, tokens per request, this process's CPU seconds), as `timed`.

    long-video: the batches follow arrival order (workload order: the texts, then the videos), but the
    arrival steps do not apply: a static batch takes no request once it runs, so a video simply waits
    for the batch before it, and no ITL is reported."""
    media_prompts = workload.mm_prompts or [None] * len(workload.prompts)
    tokens: list[list[int]] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    for b in range(0, len(workload.prompts), c.hf_batch_size):
        idx = range(b, min(b + c.hf_batch_size, len(workload.prompts)))
        prompts = [workload.prompts[i] for i in idx]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])  # [batch, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        media = _hf_media_kwargs(model, model_dir, [media_prompts[i] for i in idx], ids)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **media, do_sample=False,
                                 max_new_tokens=max(workload.output_lens[i] for i in idx),
                                 eos_token_id=None, pad_token_id=0)[:, width:]  # fmt: skip
        tokens += [out[row, : workload.output_lens[i]].tolist() for row, i in enumerate(idx)]
    return time.perf_counter() - start, tokens, time.process_time() - cpu_start


def run_hf_cb(model: torch.nn.Module, model_dir: Path, workload: Workload,
              c: ThroughputBenchConfig) -> tuple[float, list[list[int]], float]:  # fmt: skip
    """transformers' own continuous batching (`generate_batch`, paged cache) under `c`'s sequence and token
    budgets, as `timed` returns it (`model_dir` unused: both baselines take the same arguments). Text only:
    ThroughputBenchConfig refuses hf-cb with a media workload. Its KV pool is sized to the workload (its
    default sizes itself to most of the free memory, slowly, on a CPU)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 16
    pages = sum(-(-(len(p) + n) // page) for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=pages + 16, max_requests_per_batch=c.max_num_seqs,
                                  max_batch_tokens=c.max_num_batched_tokens or 0)  # fmt: skip

    def generate(prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
        # generate_batch has one max_new_tokens for all; its manager takes one per request, as here.
        config = GenerationConfig(max_new_tokens=max(max_new), do_sample=False, eos_token_id=-1,
                                  pad_token_id=0)  # fmt: skip
        results: dict[str, list[int]] = {}
        with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=cb, block=True, timeout=5, warmup=False
        ) as manager:
            for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
            while len(results) < len(prompts):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = list(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread died")
        return [results[f"r{i}"] for i in range(len(prompts))]

    generate([p[::-1] for p in workload.prompts[:2]], [2, 2])  # warm-up
    return timed(lambda: generate(workload.prompts, workload.output_lens))


def load_hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    text_only = AutoConfig.from_pretrained(model_dir).model_type == "qwen2"
    auto = AutoModelForCausalLM if text_only else AutoModelForImageTextToText
    return auto.from_pretrained(model_dir, dtype=torch.float32).eval()
