"""`mmserve bench throughput`: offline throughput of several systems on exactly the same requests,
measured in one process, with every figure also set against the model's dense-forward roofline."""

from __future__ import annotations

import gc
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mmserve.bench import SYSTEMS, WORKLOADS


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids as the engine sees them (media placeholders expanded)
    output_lens: list[int]
    # random-mm: per request the chat-templated text with placeholders and its images (PIL); the
    # engine gets these, transformers gets `prompts` plus its own image processor's pixels.
    mm_prompts: list[dict] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


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


def random_mm_workload(
    model_dir: Path,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    num_images: int = 1,
    image_size: int = 64,
    seed: int = 0,
) -> Workload:
    """Each prompt: `num_images` random images of `image_size`^2 pixels (distinct, so no cache hits) and
    a random text; `prompts` holds the engine's expanded token ids (from mmserve's own processor)."""
    import numpy as np
    from PIL import Image

    from mmserve import LLM, SamplingParams

    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    words = "red blue green circle square shape image count colour left right top bottom".split()
    mm_prompts = []
    for _ in range(num_prompts):
        images = [
            Image.fromarray(np_rng.integers(0, 255, (image_size, image_size, 3), dtype=np.uint8))
            for _ in range(num_images)
        ]
        text = " ".join(rng.choice(words) for _ in range(rng.randint(*input_len)))
        marks = "<|vision_start|><|image_pad|><|vision_end|>" * num_images
        mm_prompts.append({"prompt": _template(marks + text), "images": images})
    # Expand the placeholders once with the engine's processor (a small KV pool: nothing runs).
    processor = LLM(model_dir, num_kv_blocks=64).processor
    ids = [
        processor.process(p, SamplingParams(max_tokens=1), f"mm{i}")[0].prompt_token_ids
        for i, p in enumerate(mm_prompts)
    ]
    out_lens = [rng.randint(*output_len) for _ in range(num_prompts)]
    return Workload(ids, out_lens, mm_prompts)


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


def run_mmserve(
    model_dir: Path, workload: Workload, policy: str, max_num_seqs: int, max_num_batched_tokens: int
) -> tuple[float, float, list[list[int]], dict]:
    from mmserve import LLM, SamplingParams

    llm = LLM(
        model_dir,
        scheduler_policy=policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    prompts = workload.mm_prompts or workload.prompts
    # Warm-up on other requests than the measured ones (no prefix-cache hits for the timed run).
    warm = [p[::-1] for p in workload.prompts[:2]]
    if workload.mm_prompts is not None:
        from PIL import ImageOps

        warm = [
            {"prompt": p["prompt"], "images": [ImageOps.invert(im) for im in p["images"]]}
            for p in workload.mm_prompts[:2]
        ]
    llm.generate(warm, params[:2])
    timer = StepTimer(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    timer.remove()
    stats = llm.stats()
    peak = stats.peak_num_used_blocks / stats.num_total_blocks
    return elapsed, peak, [o.token_ids for o in outputs], timer.split(elapsed)


def _hf_media_kwargs(
    model: torch.nn.Module, model_dir: Path, workload: Workload, idx: list[int], ids: torch.Tensor
) -> dict:
    """random-mm: pixels from transformers' own image processor for the batch's images, in order."""
    if workload.mm_prompts is None:
        return {}
    from transformers import AutoImageProcessor

    images = [im for i in idx for im in workload.mm_prompts[i]["images"]]
    px = AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")
    cfg = model.config
    types = (ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long()
    return {
        "pixel_values": px["pixel_values"],
        "image_grid_thw": px["image_grid_thw"],
        "mm_token_type_ids": types,
    }


def run_hf_static(
    model: torch.nn.Module, workload: Workload, batch_size: int, pad_id: int, model_dir: Path | None = None
) -> tuple[float, list[list[int]]]:
    """transformers generate() in fixed batches, left padded, each batch running to its longest request."""
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
) -> dict:
    from tqdm import tqdm

    from mmserve.models.config import DecoderConfig

    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if workload_name not in WORKLOADS:
        raise ValueError(f"unknown workload {workload_name!r}; choose from {WORKLOADS}")
    if workload_name == "random-mm" and "hf-cb" in systems:
        raise ValueError("hf-cb runs text workloads only (random, prefix)")
    cfg, _ = DecoderConfig.from_pretrained(model_dir)
    if workload_name == "random":
        workload = random_workload(cfg.vocab_size, num_prompts, input_len, output_len, seed)
    elif workload_name == "prefix":
        workload = prefix_workload(cfg.vocab_size, num_prompts, prefix_len, input_len, output_len, seed)
    else:
        workload = random_mm_workload(
            model_dir, num_prompts, input_len, output_len, num_images, image_size, seed
        )
    hf_model = load_hf_model(model_dir)
    roofline = dense_token_rate(hf_model, cfg.vocab_size)
    bound = workload.num_output_tokens / (
        (workload.num_prompt_tokens + workload.num_output_tokens) / roofline
    )
    results: dict[str, SystemResult] = {}
    tokens: dict[str, list[list[int]]] = {}
    for system in tqdm(systems, desc="bench throughput", disable=not progress):
        peak = split = None
        if system == "hf-static":
            elapsed, tokens[system] = run_hf_static(hf_model, workload, hf_batch_size, 0, model_dir)
        elif system == "hf-cb":
            elapsed, tokens[system] = run_hf_cb(hf_model, workload, max_num_seqs, max_num_batched_tokens)
        else:
            policy = {"mmserve": "fcfs", "mmserve-no-chunk": "no_chunk", "mmserve-static": "static"}[system]
            elapsed, peak, tokens[system], split = run_mmserve(
                model_dir, workload, policy, max_num_seqs, max_num_batched_tokens
            )
        gc.collect()
        out_rate = workload.num_output_tokens / elapsed
        results[system] = SystemResult(
            system=system,
            elapsed_s=elapsed,
            requests_per_s=num_prompts / elapsed,
            output_tokens_per_s=out_rate,
            total_tokens_per_s=(workload.num_prompt_tokens + workload.num_output_tokens) / elapsed,
            efficiency=out_rate / bound,
            kv_cache_peak_usage=peak,
            step_time_split=split,
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
            "prefix_len": prefix_len if workload_name == "prefix" else None,
            "num_prompts": num_prompts,
            "input_len": input_len,
            "output_len": output_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "hf_batch_size": hf_batch_size,
            "seed": seed,
            "torch_threads": torch.get_num_threads(),
        },
        "workload": {
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": workload.num_output_tokens,
        },
        "roofline_tokens_per_s": roofline,
        "output_tokens_per_s_bound": bound,
        "systems": {k: asdict(r) for k, r in results.items()},
        # Greedy outputs of every system should agree; report how many requests differ from the first.
        "outputs_differing_from_first_system": {
            k: sum(a != b for a, b in zip(v, tokens[systems[0]], strict=True)) for k, v in tokens.items()
        },
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
    return report


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
    return "\n".join(lines)
