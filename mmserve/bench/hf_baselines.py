"""The transformers baselines of `mmserve bench throughput`: `generate()` in fixed, left-padded batches
(hf-static) and transformers' own continuous batching (hf-cb), on a workload's exact token ids."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from mmserve.bench.workload import Workload


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
        from mmserve.encoders.preprocess import load_preprocess_configs, preprocess_video

        vcfg = load_preprocess_configs(model_dir, cfg.model_type)[1]  # as mmserve's processor: family defaults
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
) -> tuple[float, list[list[int]], float]:
    """transformers generate() in fixed batches, left padded, each batch running to its longest request.
    Returns (wall seconds, tokens per request, this process's CPU seconds over the same span).

    long-video: the batches follow arrival order (workload order: the texts, then the videos), but the
    arrival steps do not apply: a static batch takes no request once it runs, so a video simply waits
    for the batch before it, and no ITL is reported."""
    order = list(range(len(workload.prompts)))
    results: list[list[int]] = [[] for _ in order]
    start, cpu_start = time.perf_counter(), time.process_time()
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
    return time.perf_counter() - start, results, time.process_time() - cpu_start


def run_hf_cb(
    model: torch.nn.Module, workload: Workload, max_num_seqs: int, max_num_batched_tokens: int
) -> tuple[float, list[list[int]], float]:
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
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = gen(workload.prompts, workload.output_lens)
    return time.perf_counter() - start, tokens, time.process_time() - cpu_start


def load_hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    auto = (
        AutoModelForCausalLM
        if AutoConfig.from_pretrained(model_dir).model_type == "qwen2"
        else AutoModelForImageTextToText
    )
    return auto.from_pretrained(model_dir, dtype=torch.float32).eval()
