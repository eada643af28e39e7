"""`mmserve bench profile`: calibrates the `slo` policy's step-time model on the loaded model. Runs a sweep
of step shapes through the real engine (prefill batches of several lengths and sizes, chunked prefills
over a growing context, decode batches, images of several sizes, videos of several temporal groups),
records each step's features and wall time, fits `StepTimeModel` by least squares and saves its JSON
(`--step-time-model` / `EngineArgs.step_time_model` load it)."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from mmserve.bench import ProfileBenchConfig
from mmserve.bench.workload import image_prompt, video_prompt
from mmserve.scheduler.step_time import FEATURES, StepFeatures, StepTimeModel


def profile(model: Path, cfg: ProfileBenchConfig) -> tuple[StepTimeModel, dict]:
    """Returns the fitted model and a report: every sample (kind, features, seconds) and the fit's error."""
    from mmserve import LLM, SamplingParams

    budget = cfg.max_num_batched_tokens
    llm = LLM(
        model, device=cfg.device, max_num_batched_tokens=budget, max_num_seqs=max(cfg.batch_sizes),
        max_num_encoder_tokens=budget, encoder_cache_size=1 << 20,
        enable_prefix_caching=False,  # every prompt computed: the features say what really ran
    )  # fmt: skip
    engine, processor = llm.engine, llm.processor
    is_mm = processor.mm_processor is not None
    samples: list[dict[str, Any]] = []
    ids = iter(range(1 << 30))
    rng = np.random.default_rng(0)
    # Plain text ids only: a random special id (an image placeholder, say) would change the request.
    special = set(llm.tokenizer.all_special_ids) | set(llm.tokenizer.added_tokens_decoder)
    plain = np.array([i for i in range(min(len(llm.tokenizer), engine.model_config.vocab_size)) if i not in special])

    def run(prompts: list[Any], max_tokens: int, kind: str) -> None:
        """Add the prompts, step until they finish, keep every step but the first of a kind's first run."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        for prompt in prompts:
            request, _ = processor.process(prompt, params, f"p{next(ids)}")
            engine.add_request(request)
        records = []
        while engine.has_unfinished_requests():
            step = engine.step()
            if step.step is not None:
                records.append(step.step)
        for r in records:
            features = StepFeatures(new_tokens=r.num_decode_tokens + r.num_prefill_tokens, num_seqs=r.num_seqs,
                                    context_tokens=r.num_context_tokens, encoder_tokens=r.num_encoder_tokens)  # fmt: skip
            step_kind = kind if r.num_prefill_tokens or r.num_encoder_tokens else "decode"
            samples.append({"kind": step_kind, "features": features.__dict__, "seconds": r.duration_s})

    def text(n: int) -> dict:
        return {"prompt_token_ids": rng.choice(plain, n).tolist()}

    run([text(8)], 2, "warmup")  # first forward: allocations, kernel selection
    samples.clear()
    for _ in range(cfg.repeats):
        for batch in cfg.batch_sizes:
            for length in cfg.prompt_lens:
                if batch * length <= budget:
                    run([text(length) for _ in range(batch)], cfg.decode_steps + 1, "prefill")
        run([text(cfg.chunked_len)], 2, "chunked-prefill")
        if is_mm:
            for size in cfg.image_sizes:
                run([image_prompt(size, int(rng.integers(1 << 30)))], 2, "image")
            for frames in cfg.video_frames:
                run([video_prompt(frames, cfg.video_size, int(rng.integers(1 << 30)))], 2, "video")
    model = StepTimeModel.fit([(StepFeatures(**s["features"]), s["seconds"]) for s in samples])
    errors = [abs(model.predict(StepFeatures(**s["features"])) - s["seconds"]) / s["seconds"] for s in samples]
    report = {
        "model": str(llm.engine.args.model),
        "config": asdict(cfg),
        "coefficients": model.coefficients,
        "features": list(FEATURES),
        "num_samples": len(samples),
        "median_relative_error": statistics.median(errors),
        "p90_relative_error": float(np.percentile(errors, 90)),
        "samples": samples,
    }
    return model, report


def format_report(report: dict) -> str:
    c = report["coefficients"]
    return "\n".join([f"step-time model of {report['model']} from {report['num_samples']} steps:",
                      *(f"  {name:<16}{c[name]:.3e} s" for name in FEATURES),
                      f"  median / p90 relative error: {report['median_relative_error']:.0%} / "
                      f"{report['p90_relative_error']:.0%}",
                      f"wrote {report['out']} (serve with --scheduler-policy slo --step-time-model {report['out']})"])  # fmt: skip


def bench_profile(model: Path, out: Path, cfg: ProfileBenchConfig) -> dict:
    fitted, report = profile(model, cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    fitted.save(out)
    report["out"] = str(out)
    return report
