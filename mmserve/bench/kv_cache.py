"""`mmserve bench kv-cache`: KV cache dtypes side by side on one checkpoint, offline (`LLM`), at one fixed
pool memory: how many sequences of the batch's length the pool holds at once (capacity, checked by running
exactly that many: all at once, none preempted), output tok/s of the same batch (engines alive together,
timed batches interleaved, the median of `repeats`), and accuracy against the first dtype's engine
(greedy-token agreement, mean |logprob difference| of the first token)."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from mmserve import LLM, SamplingParams
from mmserve.bench import KVCacheBenchConfig, num, table
from mmserve.bench.machine import cpu_model
from mmserve.bench.metrics import greedy_agreement
from mmserve.bench.workload import random_prompts
from mmserve.engine.core import DTYPES
from mmserve.engine.model_runner import ModelRunner
from mmserve.models.config import DecoderConfig

_WORDS = ("the", "a", "river", "stone", "light", "under", "quiet", "north", "table", "seven", "moves", "across",
          "blue", "winter", "green", "market", "slowly", "paper", "window", "garden")  # fmt: skip


def bench_kv_cache(model: Path, cfg: KVCacheBenchConfig) -> dict[str, Any]:
    decoder, _ = DecoderConfig.from_pretrained(model)
    block_size = 16
    memory = cfg.kv_cache_tokens * ModelRunner.kv_bytes_per_block(decoder, block_size, DTYPES[cfg.dtype]) // block_size
    rng = random.Random(cfg.seed)
    vocabulary = sorted(set(AutoTokenizer.from_pretrained(model).encode(" ".join(_WORDS))))
    batch = random_prompts(rng, cfg.num_requests, cfg.prompt_len, vocabulary)
    accuracy = random_prompts(rng, cfg.accuracy_prompts, cfg.prompt_len, vocabulary)
    max_len = cfg.prompt_len + max(cfg.output_len, cfg.accuracy_tokens)
    per_seq_blocks = -(-(cfg.prompt_len + cfg.output_len) // block_size)
    llms = {}
    try:
        for kv in cfg.kv_cache_dtypes:  # all alive at once, so the timed batches interleave
            llms[kv] = LLM(model, dtype=cfg.dtype, kv_cache_dtype=kv, kv_cache_memory=memory,
                           max_num_seqs=max(cfg.num_requests, 1024), max_model_len=max_len,
                           calculate_kv_scales=cfg.calculate_kv_scales)  # fmt: skip
        rows = {kv: _accuracy_and_capacity(llm, accuracy, batch, per_seq_blocks, cfg) for kv, llm in llms.items()}
        forced = SamplingParams(max_tokens=cfg.output_len, temperature=0.0, ignore_eos=True)
        # The whole batch (each pool runs what it holds), and a batch every pool holds at once: the cost of
        # reading FP8 codes at equal concurrency.
        equal = batch[: min(row["capacity_seqs"] for row in rows.values())]
        walls: dict[str, list[float]] = {kv: [] for kv in llms}
        equal_walls: dict[str, list[float]] = {kv: [] for kv in llms}
        for _ in range(cfg.repeats):
            for kv, llm in llms.items():
                for prompts, times in ((batch, walls), (equal, equal_walls)):
                    start = time.perf_counter()
                    llm.generate(prompts, forced)
                    times[kv].append(time.perf_counter() - start)
    finally:
        for llm in llms.values():
            llm.close()
    reference = rows[cfg.kv_cache_dtypes[0]].pop("outputs")
    results = []
    for kv, row in rows.items():
        wall = statistics.median(walls[kv])
        outputs = row.pop("outputs", reference)
        equal_wall = statistics.median(equal_walls[kv])
        results.append({**row, "output_tok_s": cfg.num_requests * cfg.output_len / wall, "wall_s": wall,
                        "equal_concurrency_seqs": len(equal),
                        "equal_concurrency_tok_s": len(equal) * cfg.output_len / equal_wall,
                        **_agreement(outputs, reference)})  # fmt: skip
    base = results[0]
    for row in results:
        row["capacity_ratio"] = row["capacity_seqs"] / max(1, base["capacity_seqs"])
        row["blocks_ratio"] = row["num_kv_blocks"] / base["num_kv_blocks"]
        row["tok_s_ratio"] = row["output_tok_s"] / base["output_tok_s"]
        row["equal_concurrency_ratio"] = row["equal_concurrency_tok_s"] / base["equal_concurrency_tok_s"]
    return {"config": {**cfg.__dict__, "kv_cache_memory": memory}, "cpu": cpu_model(), "model": str(model),
            "results": results}  # fmt: skip


def _accuracy_and_capacity(
    llm: LLM, accuracy: list[list[int]], batch: list[list[int]], per_seq_blocks: int, cfg: KVCacheBenchConfig
) -> dict[str, Any]:
    """The engine's greedy outputs on the accuracy prompts, and its capacity: the sequences of the batch's
    length its pool holds at once, checked by running exactly that many (all must run at once, unpreempted)."""
    info = llm.info()
    greedy = SamplingParams(max_tokens=cfg.accuracy_tokens, temperature=0.0, logprobs=20)
    outputs = [(o.token_ids, o.logprobs[0]) for o in llm.generate(accuracy, greedy)]
    capacity = info.num_kv_blocks // per_seq_blocks
    prompts = [batch[i % len(batch)] for i in range(capacity)]
    before = llm.stats().num_preemptions
    llm.step_records.clear()
    llm.generate(prompts, SamplingParams(max_tokens=cfg.output_len, temperature=0.0, ignore_eos=True))
    return {
        "kv_cache_dtype": info.kv_cache_dtype,
        "num_kv_blocks": info.num_kv_blocks,
        "kv_bytes_per_token": info.kv_bytes_per_token,
        "kv_cache_bytes": info.kv_cache_bytes,
        "capacity_seqs": capacity,
        "capacity_peak_running": max((r.num_seqs for r in llm.step_records), default=0),
        "capacity_preemptions": llm.stats().num_preemptions - before,
        "outputs": outputs,
    }


def _agreement(outputs: list[tuple[list[int], dict[int, float]]],
               reference: list[tuple[list[int], dict[int, float]]]) -> dict[str, float]:  # fmt: skip
    """`greedy_agreement`, and the mean |logprob difference| of the reference's first token (both saw the same
    prompt; a token outside the top 20 counts the 20th's logprob)."""
    diffs = [abs(first.get(ref[0], min(first.values())) - ref_first[ref[0]])
             for (_, first), (ref, ref_first) in zip(outputs, reference, strict=True)]  # fmt: skip
    return {**greedy_agreement([o for o, _ in outputs], [r for r, _ in reference]),
            "first_token_mean_abs_logprob_diff": sum(diffs) / max(1, len(diffs))}  # fmt: skip


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    rows = [(r["kv_cache_dtype"], r["num_kv_blocks"], num(r["kv_bytes_per_token"], ".0f"),
             f"{r['capacity_peak_running']}/{r['capacity_seqs']}", num(r["capacity_ratio"], ".2f") + "x",
             r["capacity_preemptions"], num(r["output_tok_s"]), num(r["tok_s_ratio"], ".2f") + "x",
             f"{r['equal_concurrency_tok_s']:.1f} ({r['equal_concurrency_seqs']})",
             num(r["equal_concurrency_ratio"], ".2f") + "x", num(r["greedy_token_agreement"], ".2f"),
             num(r["identical_outputs"], ".2f"), num(r["first_token_mean_abs_logprob_diff"], ".3f"))
            for r in report["results"]]  # fmt: skip
    return (f"KV cache dtypes on {report['cpu']}: {cfg['dtype']} compute, {cfg['kv_cache_memory'] / 2**20:.1f} MiB "
            f"pool, {cfg['num_requests']} requests x ({cfg['prompt_len']} + {cfg['output_len']}) tokens\n"
            + table(("kv dtype", "blocks", "B/token", "seqs held", "capacity", "preempt", "tok/s", "ratio",
                     "equal-conc tok/s", "ratio", "agree", "same", "|dlogp|"), rows))  # fmt: skip
