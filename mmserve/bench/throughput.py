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

from mmserve.bench import SYSTEMS


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

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
) -> tuple[float, float, list[list[int]]]:
    from mmserve import LLM, SamplingParams

    llm = LLM(
        model_dir,
        scheduler_policy=policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens]
    llm.generate(workload.prompts[:2], params[:2])  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    return elapsed, stats.peak_num_used_blocks / stats.num_total_blocks, [o.token_ids for o in outputs]


def run_hf_static(
    model: torch.nn.Module, workload: Workload, batch_size: int, pad_id: int
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
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_id,
            )
        for row, i in enumerate(idx):
            results[i] = out[row, width : width + workload.output_lens[i]].tolist()
    return time.perf_counter() - start, results


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
) -> dict:
    from mmserve.models.config import DecoderConfig

    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    cfg, _ = DecoderConfig.from_pretrained(model_dir)
    workload = random_workload(cfg.vocab_size, num_prompts, input_len, output_len, seed)
    hf_model = load_hf_model(model_dir)
    roofline = dense_token_rate(hf_model, cfg.vocab_size)
    bound = workload.num_output_tokens / (
        (workload.num_prompt_tokens + workload.num_output_tokens) / roofline
    )
    results: dict[str, SystemResult] = {}
    tokens: dict[str, list[list[int]]] = {}
    for system in systems:
        peak = None
        if system == "hf-static":
            elapsed, tokens[system] = run_hf_static(hf_model, workload, hf_batch_size, pad_id=0)
        else:
            policy = {"mmserve": "fcfs", "mmserve-no-chunk": "no_chunk", "mmserve-static": "static"}[system]
            elapsed, peak, tokens[system] = run_mmserve(
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
    return "\n".join(lines)
