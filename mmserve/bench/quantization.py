"""`mmserve bench quantization`: each quantized format of one dense checkpoint (written by `mmserve.quantize`)
on each compute path, against the dense checkpoint itself, offline (`LLM`): weight bytes held, accuracy on the
same prompts (greedy-token agreement of free-running decoding, the share of identical continuations, and the
mean |logprob difference| of the dense model's greedy tokens teacher-forced: each position's prompt is the dense
model's own prefix), prefill tok/s, and decode tok/s at batch 1 and at a batch. Every engine stays alive and the
timed runs go round all of them `repeats` times (the median round counts), so a load drifting on a shared machine
weighs on every engine alike."""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mmserve.bench import BENCH_FORMATS, QuantizationBenchConfig, num, table  # noqa: F401  (BENCH_FORMATS: tests check it)
from mmserve.bench.machine import cpu_model
from mmserve.bench.metrics import greedy_agreement
from mmserve.bench.workload import random_prompts

_PLAIN_IDS = 4000  # prompt ids drawn below this and below the first special token's id


def bench_quantization(model: Path, cfg: QuantizationBenchConfig) -> dict[str, Any]:
    """Quantize `model` into each format, start the dense engine and one per (format, path), all alive together,
    measure accuracy and bytes, then time them in interleaved rounds (a machine whose load drifts slows every
    engine alike; each figure is the median of its rounds)."""
    import torch

    from mmserve.quantize import quantize_checkpoint

    rng = random.Random(cfg.seed)
    limit = _plain_id_limit(model)
    prompts = {
        "accuracy": random_prompts(rng, cfg.accuracy_prompts, cfg.prompt_len, range(limit)),
        "prefill": random_prompts(rng, cfg.prefill_prompts, cfg.prefill_len, range(limit)),
        "decode": random_prompts(rng, cfg.decode_batch, cfg.prompt_len, range(limit)),
    }
    engines: dict[tuple[str, str], Any] = {}
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(cfg.workdir or tmp)
        try:
            engines[("dense", "-")], rows[("dense", "-")] = _start(model, None, cfg)
            reference = _greedy(engines[("dense", "-")], prompts["accuracy"], cfg)
            for fmt in cfg.formats:
                quantized = workdir / f"{fmt}-g{cfg.group_size}"
                start = time.perf_counter()
                if not (quantized / "config.json").exists():  # else reused from an earlier run's workdir
                    quantize_checkpoint(model, quantized, fmt, group_size=cfg.group_size)
                quantize_s = time.perf_counter() - start
                for path in cfg.paths:
                    llm, row = _start(quantized, path, cfg)
                    engines[(fmt, path)] = llm
                    outputs = _greedy(llm, prompts["accuracy"], cfg)
                    rows[(fmt, path)] = {**row, **_accuracy(llm, prompts["accuracy"], outputs, reference),
                                         "quantize_s": quantize_s}  # fmt: skip
            timings = _timed_rounds(engines, prompts, cfg, limit)
        finally:
            for llm in engines.values():
                llm.close()
    dense = rows[("dense", "-")]
    results = []
    for (fmt, path), row in rows.items():
        row = {"format": fmt, "path": path, **row, **timings[(fmt, path)]}
        row["weight_bytes_ratio"] = row["weight_bytes"] / dense["weight_bytes"]
        for key in ("prefill_tok_s", "decode_tok_s", "decode_batch1_tok_s"):
            row[f"{key}_ratio"] = row[key] / timings[("dense", "-")][key]
        results.append(row)
    machine = {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    return {"config": asdict(cfg), "machine": machine, "model": str(model), "results": results}


def _plain_id_limit(model: Path) -> int:
    """Prompt ids stay below this: plain tokens (the tiny presets' and Qwen's special tokens follow the BPE ones)."""
    from transformers import AutoTokenizer

    specials = AutoTokenizer.from_pretrained(model).all_special_ids
    return min([_PLAIN_IDS, *specials])


def _start(model_dir: Path, path: str | None, cfg: QuantizationBenchConfig) -> tuple[Any, dict[str, Any]]:
    """An engine on `model_dir` with the compute path `path` (None: a dense checkpoint), and its load figures."""
    from mmserve import LLM

    start = time.perf_counter()
    llm = LLM(model_dir, dtype=cfg.dtype, num_kv_blocks=_blocks_needed(cfg), max_num_seqs=1024, quant_compute=path,
              max_num_batched_tokens=max(2048, cfg.prefill_len))  # fmt: skip
    return llm, {"weight_bytes": llm.info().weight_bytes, "load_s": time.perf_counter() - start}


def _greedy(llm: Any, prompts: list[list[int]], cfg: QuantizationBenchConfig) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens on the accuracy prompts and their logprobs."""
    from mmserve import SamplingParams

    params = SamplingParams(max_tokens=cfg.accuracy_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    return [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids, strict=True)])
            for o in llm.generate(prompts, params)]  # fmt: skip


def _timed_rounds(engines: dict[tuple[str, str], Any], prompts: dict[str, list[list[int]]],
                  cfg: QuantizationBenchConfig, limit: int) -> dict[tuple[str, str], dict[str, float]]:  # fmt: skip
    """Prefill tok/s, decode tok/s of the batch and of one sequence per engine: `repeats` rounds over every
    engine in turn, the median round of each."""
    from mmserve import SamplingParams

    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=cfg.decode_tokens, temperature=0.0, ignore_eos=True)
    runs = {
        "prefill_tok_s": (prompts["prefill"], prefill, cfg.prefill_prompts * cfg.prefill_len),
        "decode_tok_s": (prompts["decode"], decode, cfg.decode_batch * cfg.decode_tokens),
        "decode_batch1_tok_s": (prompts["decode"][:1], decode, cfg.decode_tokens),
    }
    walls: dict[tuple[str, str], dict[str, list[float]]] = {key: {name: [] for name in runs} for key in engines}
    for i in range(cfg.repeats):
        for key, llm in engines.items():
            for name, (batch, params, _) in runs.items():
                # A new first token per round: the prefix cache never serves a prompt, so each round does the same work.
                fresh = [[(p[0] + i + 1) % limit, *p[1:]] for p in batch]
                start = time.perf_counter()
                llm.generate(fresh, params)
                walls[key][name].append(time.perf_counter() - start)
    return {key: {name: runs[name][2] / statistics.median(w) for name, w in by_run.items()}
            for key, by_run in walls.items()}  # fmt: skip


def _blocks_needed(cfg: QuantizationBenchConfig, block_size: int = 16) -> int:
    """A pool holding every batch the bench submits at once (teacher-forced accuracy is the largest)."""
    accuracy = cfg.accuracy_prompts * cfg.accuracy_tokens * -(-(cfg.prompt_len + cfg.accuracy_tokens) // block_size)
    prefill = cfg.prefill_prompts * -(-(cfg.prefill_len + 1) // block_size)
    decode = cfg.decode_batch * -(-(cfg.prompt_len + cfg.decode_tokens) // block_size)
    return max(accuracy, prefill, decode) + 16


def _accuracy(llm: Any, prompts: list[list[int]], outputs: list[tuple[list[int], list[float]]],
              reference: list[tuple[list[int], list[float]]]) -> dict[str, float]:  # fmt: skip
    """Free-running agreement with the dense model's greedy outputs, and teacher-forced logprob differences."""
    from mmserve import SamplingParams

    forced = [p + ref[:i] for p, (ref, _) in zip(prompts, reference, strict=True) for i in range(len(ref))]
    expected = [(ref[i], lps[i]) for ref, lps in reference for i in range(len(ref))]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=20)
    diffs, top1 = [], 0
    for out, (token, logprob) in zip(llm.generate(forced, params), expected, strict=True):
        got = out.logprobs[0]
        diffs.append(abs(got.get(token, min(got.values())) - logprob))  # outside the top 20: at least that far
        top1 += out.token_ids[0] == token
    return {
        **greedy_agreement([t for t, _ in outputs], [t for t, _ in reference]),
        "teacher_forced_top1_agreement": top1 / max(1, len(expected)),
        "mean_abs_logprob_diff": sum(diffs) / max(1, len(diffs)),
        "max_abs_logprob_diff": max(diffs, default=0.0),
    }


def format_report(report: dict[str, Any]) -> str:
    cfg, machine = report["config"], report["machine"]
    rows = [(r["format"], r["path"], num(r["weight_bytes"] / 2**20), num(r["weight_bytes_ratio"], ".2f"),
             num(r.get("greedy_token_agreement", 1.0), ".2f"), num(r.get("identical_outputs", 1.0), ".2f"),
             num(r.get("mean_abs_logprob_diff", 0.0), ".4f"), num(r["prefill_tok_s"], ".0f"), num(r["decode_tok_s"]),
             num(r["decode_batch1_tok_s"])) for r in report["results"]]  # fmt: skip
    return (f"model {report['model']} ({cfg['dtype']}), {machine['cpu']}, {machine['threads']} threads\n"
            + table(("format", "path", "weights MiB", "ratio", "agree", "ident", "|dlogp|", "prefill t/s",
                     "decode t/s", "b1 t/s"), rows))  # fmt: skip
