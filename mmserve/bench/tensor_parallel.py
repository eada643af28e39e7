"""`mmserve bench tensor-parallel`: steady-state decode step time of one checkpoint at several
tensor-parallel sizes side by side, with the bytes the first rank put into collectives per step.
Every engine is built once, then they take turns round by round (never two stepping at once)."""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmserve.bench import TensorParallelBenchConfig, num, table
from mmserve.bench.machine import cpu_model, cpu_times, load_average, other_cpu
from mmserve.bench.workload import plain_ids, random_prompts
from mmserve.engine.messages import StepRecord

if TYPE_CHECKING:
    from mmserve import LLM
    from mmserve.models.config import DecoderConfig


def comm_model(cfg: DecoderConfig, tp: int, num_tokens: int, dtype: torch.dtype) -> dict:
    """Bytes the first rank puts into collectives in a text decode step of `num_tokens` tokens, by the
    layers' recipe (models/parallel.py): the vocab-parallel embedding and each layer's o_proj and down
    projection all-reduce [num_tokens, hidden] in the model's dtype; the LM head gathers this rank's
    fp32 logits [num_tokens, padded vocab / tp] to the first rank. Zero with one rank."""
    num_all_reduces = 0 if tp == 1 else 1 + 2 * cfg.num_layers
    all_reduce = num_all_reduces * num_tokens * cfg.hidden_size * dtype.itemsize
    gather = 0 if tp == 1 else num_tokens * math.ceil(cfg.vocab_size / tp) * 4
    return {"all_reduce": all_reduce, "gather": gather, "total": all_reduce + gather, "num_all_reduces": num_all_reduces}


def _run_once(llm: LLM, prompts: list[list[int]], output_len: int) -> tuple[list[StepRecord], list[list[int]]]:
    from mmserve import SamplingParams

    llm.step_records.clear()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    return list(llm.step_records), [list(o.token_ids) for o in outputs]


def bench_tensor_parallel(model_dir: Path, cfg: TensorParallelBenchConfig, progress: bool = False) -> dict:
    """Every TP size on the same requests, alternating: for each round and concurrency the sizes run
    one after another (reversed every other round, so drift on a shared machine hits them alike)."""
    from mmserve import LLM
    from mmserve.models.config import DecoderConfig
    from mmserve.models.parallel import check_tensor_parallel

    model_cfg, _ = DecoderConfig.from_pretrained(model_dir)
    for tp in cfg.tensor_parallel_sizes:  # before any engine starts
        check_tensor_parallel(model_cfg, tp)
    base_threads = torch.get_num_threads()
    load_before, cpu_before = load_average(), cpu_times()
    llms: dict[int, LLM] = {}
    engines: dict[int, dict] = {}
    steps: dict[tuple[int, int], list[list[StepRecord]]] = {}  # (tp, concurrency) -> per round, its decode steps
    differing: dict[tuple[int, int], int] = {}  # (tp, concurrency) -> most requests unlike the first size's
    try:
        for tp in cfg.tensor_parallel_sizes:
            start = time.perf_counter()
            llms[tp] = LLM(model_dir, tensor_parallel_size=tp, max_num_seqs=max(cfg.concurrency),
                           block_size=cfg.block_size, max_num_batched_tokens=cfg.max_num_batched_tokens,
                           num_kv_blocks=cfg.num_kv_blocks)  # fmt: skip
            info = llms[tp].engine.info()
            engines[tp] = {
                "startup_s": time.perf_counter() - start,
                # On the CPU a multi-rank engine splits the cores among its ranks (and sets this process's
                # threads to its share); a one-rank engine keeps what the process had.
                "torch_threads_per_rank": torch.get_num_threads(),
                "device": info.device, "dtype": info.dtype, "attention_backend": info.attention_backend,
                "weight_bytes_per_rank": info.weight_bytes, "kv_cache_bytes_per_rank": info.kv_cache_bytes,
            }  # fmt: skip
            torch.set_num_threads(base_threads)
            if progress:
                print(f"tp={tp}: started in {engines[tp]['startup_s']:.1f} s", flush=True)
        ids = plain_ids(model_cfg.vocab_size)
        warm = random_prompts(random.Random(cfg.seed + 10_000), max(cfg.concurrency), cfg.input_len, ids)
        for tp, llm in llms.items():
            torch.set_num_threads(engines[tp]["torch_threads_per_rank"])
            _run_once(llm, warm, 4)
        for rnd in range(cfg.rounds):
            order = list(cfg.tensor_parallel_sizes)[:: -1 if rnd % 2 else 1]
            for c_index, concurrency in enumerate(cfg.concurrency):
                prompts = random_prompts(random.Random(cfg.seed + 100 * rnd + c_index), concurrency, cfg.input_len, ids)
                tokens: dict[int, list[list[int]]] = {}
                for tp in order:
                    torch.set_num_threads(engines[tp]["torch_threads_per_rank"])
                    start = time.perf_counter()
                    records, tokens[tp] = _run_once(llms[tp], prompts, cfg.output_len)
                    # pure decode steps, every request decoding: no prefill, no media, `concurrency` tokens
                    pure = [s for s in records if s.num_decode_tokens == concurrency
                            and s.num_prefill_tokens == s.num_encoder_tokens == 0]  # fmt: skip
                    if not pure:
                        raise ValueError(f"tp={tp}, concurrency {concurrency}: no step had every request decoding "
                                         "(raise --output-len or --max-num-batched-tokens)")  # fmt: skip
                    steps.setdefault((tp, concurrency), []).append(pure)
                    if progress:
                        print(f"round {rnd + 1}/{cfg.rounds} concurrency {concurrency} tp={tp}: {len(pure)} decode "
                              f"steps, median {np.median([s.duration_s for s in pure]) * 1e3:.1f} ms "
                              f"({time.perf_counter() - start:.1f} s)", flush=True)  # fmt: skip
                first = tokens[cfg.tensor_parallel_sizes[0]]
                for tp, toks in tokens.items():
                    n = sum(a != b for a, b in zip(toks, first, strict=True))
                    differing[(tp, concurrency)] = max(differing.get((tp, concurrency), 0), n)
    finally:
        for tp in reversed(list(llms)):
            llms[tp].close()
        torch.set_num_threads(base_threads)
    # The ranks are waited for in close(), so their CPU time is in this process's children's times now.
    contention = {"load_average_before": load_before, "load_average_after": load_average(),
                  **other_cpu(cpu_before, cpu_times())}  # fmt: skip
    results: dict[str, dict[str, dict]] = {}
    for (tp, concurrency), per_round in steps.items():
        cell = [s for r in per_round for s in r]
        durations = np.array([s.duration_s for s in cell])
        forward = np.array([s.forward_duration_s for s in cell])
        sampling = np.array([s.sampling_duration_s for s in cell])
        comm = float(np.mean([s.comm_bytes for s in cell]))
        median = float(np.median(durations))
        model = comm_model(model_cfg, tp, concurrency, getattr(torch, engines[tp]["dtype"]))
        results.setdefault(str(tp), {})[str(concurrency)] = {
            "num_steps": len(cell),
            "median_step_s": median,
            "p90_step_s": float(np.percentile(durations, 90)),
            "median_forward_s": float(np.median(forward)),
            "median_sampling_s": float(np.median(sampling)),
            # scheduler, plan building and (TP > 1) the plan's broadcast to the other ranks
            "median_other_s": float(np.median(durations - forward - sampling)),
            "decode_tokens_per_s": concurrency / median,
            "mean_comm_bytes": comm,
            "comm_bytes_per_decode_token": comm / concurrency,
            "round_median_step_s": [float(np.median([s.duration_s for s in r])) for r in per_round],
            "step_durations_s": durations.tolist(),
            "comm_bytes_model": model,
            "comm_bytes_match_model": comm == model["total"],
            # bytes all-reduced per decode token: the measured total less the LM head's logit gather
            "all_reduce_bytes_per_decode_token": (comm - model["gather"]) / concurrency,
            "outputs_differing_from_first_size": differing[(tp, concurrency)],
        }
    base_tp = 1 if 1 in cfg.tensor_parallel_sizes else cfg.tensor_parallel_sizes[0]
    base = results[str(base_tp)]
    return {
        "config": {"model": str(model_dir), **asdict(cfg), "num_kv_blocks": cfg.num_kv_blocks},
        "machine": {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": base_threads,
                    "torch_version": torch.__version__, "contention": contention},
        "engines": {str(tp): e for tp, e in engines.items()},
        "results": results,
        "base_tensor_parallel_size": base_tp,
        # median decode step time of each TP size over the base size's, per concurrency
        "step_time_ratio_to_base": {
            tp: {c: row["median_step_s"] / base[c]["median_step_s"] for c, row in by_c.items()}
            for tp, by_c in results.items() if tp != str(base_tp)
        },
    }  # fmt: skip


def format_report(report: dict) -> str:
    m, cont, ratios = report["machine"], report["machine"]["contention"], report["step_time_ratio_to_base"]
    threads = ", ".join(f"TP={tp}: {e['torch_threads_per_rank']}" for tp, e in report["engines"].items())
    lines = [f"{m['cpu_model']}, {m['cpu_count']} CPUs; torch threads per rank {threads}"]
    if cont.get("other_cpu_s") is not None:
        lines.append(f"other processes used {cont['other_cpu_s']:.1f} CPU-s ({cont['other_cpu_share']:.1%} of the "
                     f"machine) and the hypervisor stole {cont['steal_s']:.1f} s over the {cont['wall_s']:.0f} s run")
    rows = [(tp, c, r["num_steps"], num(r["median_step_s"] * 1e3, ".2f"), num(r["p90_step_s"] * 1e3, ".2f"),
             num(r["median_forward_s"] * 1e3, ".2f"), num(r["median_other_s"] * 1e3, ".2f"),
             num(r["decode_tokens_per_s"], ".0f"), num(r["mean_comm_bytes"], ".0f"),
             num(r["all_reduce_bytes_per_decode_token"], ".0f"), num(ratios.get(tp, {}).get(c), ".2f"))
            for tp, by_c in report["results"].items() for c, r in by_c.items()]  # fmt: skip
    lines.append(table(("TP", "conc", "steps", "median ms", "p90 ms", "fwd ms", "other ms", "tok/s", "comm B/step",
                        "all-reduce B/tok", "vs base"), rows))  # fmt: skip
    cells = [(f"TP={tp} c={c}", r) for tp, by_c in report["results"].items() for c, r in by_c.items()]
    if mismatched := [name for name, r in cells if not r["comm_bytes_match_model"]]:
        lines.append("measured comm bytes differ from the layers' recipe at: " + ", ".join(mismatched))
    if differ := [f"{name}: {r['outputs_differing_from_first_size']}" for name, r in cells
                  if r["outputs_differing_from_first_size"]]:  # fmt: skip
        lines.append("greedy outputs differing from the first TP size (requests): " + "; ".join(differ))
    return "\n".join(lines)
