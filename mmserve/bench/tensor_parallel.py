"""`mmserve bench tensor-parallel`: steady-state decode step time of one checkpoint at several
tensor-parallel sizes side by side, with the bytes the first rank put into collectives per step.
Every engine is built once, then they take turns round by round (never two stepping at once)."""

from __future__ import annotations

import json
import math
import os
import platform
import random
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmserve.bench import TensorParallelBenchConfig
from mmserve.engine.messages import StepRecord

if TYPE_CHECKING:
    from mmserve import LLM

JSON_NAME = "tensor_parallel.json"
PLOT_NAME = "tensor_parallel.png"


def default_model() -> Path:
    """The Qwen2 (text) bench preset, made once into ~/.cache/mmserve."""
    from mmserve.tiny_model import make_tiny_model

    model = Path.home() / ".cache" / "mmserve" / "bench-qwen2"
    if not (model / "config.json").exists():
        make_tiny_model(model, arch="qwen2", preset="bench", seed=0)
    return model


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo's `model name`), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def decode_steps(steps: Sequence[StepRecord], num_requests: int) -> list[StepRecord]:
    """Pure decode steps with every request decoding: no prefill, no media, `num_requests` tokens."""
    return [
        s
        for s in steps
        if s.num_decode_tokens == num_requests and s.num_prefill_tokens == 0 and s.num_encoder_tokens == 0
    ]


def comm_model(model_dir: Path, tp: int, num_tokens: int, dtype: torch.dtype) -> dict:
    """Bytes the first rank puts into collectives in a text decode step of `num_tokens` tokens, by the
    layers' recipe (models/parallel.py): the vocab-parallel embedding and each layer's o_proj and down
    projection all-reduce [num_tokens, hidden] in the model's dtype; the LM head gathers this rank's
    fp32 logits [num_tokens, padded vocab / tp] to the first rank. Zero with one rank."""
    from mmserve.models.config import DecoderConfig

    cfg, _ = DecoderConfig.from_pretrained(model_dir)
    if tp == 1:
        return {"all_reduce": 0, "gather": 0, "total": 0, "num_all_reduces": 0}
    all_reduce = (1 + 2 * cfg.num_layers) * num_tokens * cfg.hidden_size * dtype.itemsize
    gather = num_tokens * math.ceil(cfg.vocab_size / tp) * 4
    return {
        "all_reduce": all_reduce,
        "gather": gather,
        "total": all_reduce + gather,
        "num_all_reduces": 1 + 2 * cfg.num_layers,
    }


def _prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids well inside the vocabulary, away from the special tokens at its end (as workload.py).
    return [[rng.randrange(100, vocab_size - 200) for _ in range(length)] for _ in range(num)]


def _stats(steps: list[StepRecord], concurrency: int, per_round: list[list[StepRecord]]) -> dict:
    durations = np.array([s.duration_s for s in steps])
    forward = np.array([s.forward_duration_s for s in steps])
    sampling = np.array([s.sampling_duration_s for s in steps])
    comm = np.array([s.comm_bytes for s in steps])
    median = float(np.median(durations))
    return {
        "num_steps": len(steps),
        "median_step_s": median,
        "p90_step_s": float(np.percentile(durations, 90)),
        "median_forward_s": float(np.median(forward)),
        "median_sampling_s": float(np.median(sampling)),
        # scheduler, plan building and (TP > 1) the plan's broadcast to the other ranks
        "median_other_s": float(np.median(durations - forward - sampling)),
        "decode_tokens_per_s": concurrency / median,
        "mean_comm_bytes": float(comm.mean()),
        "comm_bytes_per_decode_token": float(comm.mean()) / concurrency,
        "round_median_step_s": [float(np.median([s.duration_s for s in r])) for r in per_round],
        "step_durations_s": [float(d) for d in durations],
    }


def _build(model_dir: Path, tp: int, cfg: TensorParallelBenchConfig) -> tuple[LLM, dict]:
    from mmserve import LLM

    threads_before = torch.get_num_threads()
    start = time.perf_counter()
    llm = LLM(
        model_dir,
        tensor_parallel_size=tp,
        max_num_seqs=max(cfg.concurrency),
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        block_size=cfg.block_size,
        num_kv_blocks=cfg.num_kv_blocks,
    )
    info = llm.engine.info()
    engine = {
        "startup_s": time.perf_counter() - start,
        # On the CPU a multi-rank engine splits the cores among its ranks (and sets this process's
        # threads to its share); a one-rank engine keeps what the process had.
        "torch_threads_per_rank": torch.get_num_threads(),
        "device": info.device,
        "dtype": info.dtype,
        "attention_backend": info.attention_backend,
        "weight_bytes_per_rank": getattr(info, "weight_bytes", None),
        "kv_cache_bytes_per_rank": info.kv_cache_bytes,
    }
    torch.set_num_threads(threads_before)
    return llm, engine


def _run_once(
    llm: LLM, prompts: list[list[int]], output_len: int
) -> tuple[list[StepRecord], list[list[int]]]:
    from mmserve import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.step_records.clear()
    outputs = llm.generate(prompts, params)
    return list(llm.step_records), [list(o.token_ids) for o in outputs]


def bench_tensor_parallel(
    model_dir: Path, cfg: TensorParallelBenchConfig, out_dir: Path | None = None, progress: bool = False
) -> dict:
    """Every TP size on the same requests, alternating: for each round and concurrency the sizes run
    one after another (reversed every other round, so drift on a shared machine hits them alike)."""
    from mmserve.models.config import DecoderConfig
    from mmserve.models.parallel import check_tensor_parallel

    model_cfg, _ = DecoderConfig.from_pretrained(model_dir)
    for tp in cfg.tensor_parallel_sizes:  # before any engine starts
        check_tensor_parallel(model_cfg, tp)
    base_threads = torch.get_num_threads()
    load_before, cpu_before = _load_average(), _cpu_times()
    llms: dict[int, LLM] = {}
    engines: dict[int, dict] = {}
    # (tp, concurrency) -> per round, its pure decode steps
    steps: dict[tuple[int, int], list[list[StepRecord]]] = {}
    differing: dict[tuple[int, int], int] = {}
    try:
        for tp in cfg.tensor_parallel_sizes:
            llms[tp], engines[tp] = _build(model_dir, tp, cfg)
            if progress:
                print(f"tp={tp}: started in {engines[tp]['startup_s']:.1f} s", flush=True)
        warm = _prompts(model_cfg.vocab_size, max(cfg.concurrency), cfg.input_len, cfg.seed + 10_000)
        for tp, llm in llms.items():
            torch.set_num_threads(engines[tp]["torch_threads_per_rank"])
            _run_once(llm, warm, 4)
        for rnd in range(cfg.rounds):
            order = list(cfg.tensor_parallel_sizes)
            if rnd % 2:
                order.reverse()
            for c_index, concurrency in enumerate(cfg.concurrency):
                prompts = _prompts(
                    model_cfg.vocab_size, concurrency, cfg.input_len, cfg.seed + 100 * rnd + c_index
                )
                tokens: dict[int, list[list[int]]] = {}
                for tp in order:
                    torch.set_num_threads(engines[tp]["torch_threads_per_rank"])
                    start = time.perf_counter()
                    records, tokens[tp] = _run_once(llms[tp], prompts, cfg.output_len)
                    pure = decode_steps(records, concurrency)
                    if not pure:
                        raise ValueError(
                            f"tp={tp}, concurrency {concurrency}: no step had every request decoding "
                            f"(raise --output-len or --max-num-batched-tokens)"
                        )
                    steps.setdefault((tp, concurrency), []).append(pure)
                    if progress:
                        print(
                            f"round {rnd + 1}/{cfg.rounds} concurrency {concurrency} tp={tp}: "
                            f"{len(pure)} decode steps, median {np.median([s.duration_s for s in pure]) * 1e3:.1f} ms "
                            f"({time.perf_counter() - start:.1f} s)",
                            flush=True,
                        )
                first = tokens[cfg.tensor_parallel_sizes[0]]
                for tp, toks in tokens.items():
                    n = sum(a != b for a, b in zip(toks, first, strict=True))
                    differing[(tp, concurrency)] = max(differing.get((tp, concurrency), 0), n)
    finally:
        for tp in reversed(list(llms)):
            llms[tp].close()
        torch.set_num_threads(base_threads)
    # The ranks are waited for in close(), so their CPU time is in this process's children's times now.
    contention = {
        "load_average_before": load_before,
        "load_average_after": _load_average(),
        **_other_cpu(cpu_before, _cpu_times()),
    }
    return _report(model_dir, cfg, engines, steps, differing, base_threads, contention, out_dir)


def _cpu_times() -> tuple[float, float, list[int] | None]:
    """(wall clock, CPU seconds of this process and its waited-for children, /proc/stat's cpu line)."""
    t = os.times()
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        stat = [int(x) for x in fields]
    except (OSError, ValueError, IndexError):
        stat = None
    return time.monotonic(), t.user + t.system + t.children_user + t.children_system, stat


def _other_cpu(before: tuple, after: tuple) -> dict:
    """CPU time the machine spent outside this benchmark (its process and ranks) while it ran, and the
    time the hypervisor stole: a shared machine's contention, which inflates step times unevenly (a
    two-thread engine waits at every parallel region for a descheduled thread)."""
    wall, mine = after[0] - before[0], after[1] - before[1]
    if before[2] is None or after[2] is None:
        return {"wall_s": wall, "other_cpu_s": None, "steal_s": None}
    hz = os.sysconf("SC_CLK_TCK")
    delta = [b - a for a, b in zip(before[2], after[2], strict=False)]
    busy = sum(delta[i] for i in (0, 1, 2, 5, 6) if i < len(delta)) / hz  # user nice system irq softirq
    steal = delta[7] / hz if len(delta) > 7 else 0.0
    other = max(0.0, busy - mine)
    return {
        "wall_s": wall,
        "other_cpu_s": other,
        "other_cpu_share": other / (wall * (os.cpu_count() or 1)),  # of all the machine's CPU time
        "steal_s": steal,
    }


def _load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: well above the ranks' own threads, other work shared the CPUs."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _report(
    model_dir: Path,
    cfg: TensorParallelBenchConfig,
    engines: dict[int, dict],
    steps: dict[tuple[int, int], list[list[StepRecord]]],
    differing: dict[tuple[int, int], int],
    base_threads: int,
    contention: dict,
    out_dir: Path | None,
) -> dict:
    base_tp = 1 if 1 in cfg.tensor_parallel_sizes else cfg.tensor_parallel_sizes[0]
    results: dict[str, dict[str, dict]] = {}
    for tp in cfg.tensor_parallel_sizes:
        dtype = getattr(torch, engines[tp]["dtype"])
        results[str(tp)] = {}
        for concurrency in cfg.concurrency:
            per_round = steps[(tp, concurrency)]
            row = _stats([s for r in per_round for s in r], concurrency, per_round)
            model = comm_model(model_dir, tp, concurrency, dtype)
            row["comm_bytes_model"] = model
            row["comm_bytes_match_model"] = row["mean_comm_bytes"] == model["total"]
            # bytes all-reduced per decode token: the measured total less the LM head's logit gather
            row["all_reduce_bytes_per_decode_token"] = (
                row["mean_comm_bytes"] - model["gather"]
            ) / concurrency
            row["outputs_differing_from_first_size"] = differing[(tp, concurrency)]
            results[str(tp)][str(concurrency)] = row
    ratios = {
        str(tp): {
            str(c): results[str(tp)][str(c)]["median_step_s"] / results[str(base_tp)][str(c)]["median_step_s"]
            for c in cfg.concurrency
        }
        for tp in cfg.tensor_parallel_sizes
        if tp != base_tp
    }
    report = {
        "config": {"model": str(model_dir), **asdict(cfg), "num_kv_blocks": cfg.num_kv_blocks},
        "machine": {
            "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count(),
            "torch_threads": base_threads,
            "torch_version": torch.__version__,
            "contention": contention,
        },
        "engines": {str(tp): e for tp, e in engines.items()},
        "results": results,
        "base_tensor_parallel_size": base_tp,
        # median decode step time of each TP size over the base size's, per concurrency
        "step_time_ratio_to_base": ratios,
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / JSON_NAME).write_text(json.dumps(report, indent=2))
    return report


def plot_tensor_parallel(report: dict, out_dir: Path) -> list[Path]:
    """Median decode step time (p90 as the bar's top) against concurrency, one line per TP size, and
    the ratio to the base size."""
    from mmserve.bench.plots import _pyplot

    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    concurrency = report["config"]["concurrency"]
    fig, (ax, rax) = plt.subplots(1, 2, figsize=(9, 3.4))
    for tp, by_c in report["results"].items():
        med = [by_c[str(c)]["median_step_s"] * 1e3 for c in concurrency]
        p90 = [by_c[str(c)]["p90_step_s"] * 1e3 for c in concurrency]
        ax.errorbar(concurrency, med, yerr=[np.zeros(len(med)), np.subtract(p90, med)], marker="o",
                    capsize=3, label=f"TP={tp}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrency, [str(c) for c in concurrency])
    ax.set_xlabel("concurrent decoding requests")
    ax.set_ylabel("decode step (ms): median, bar to p90")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    base = report["base_tensor_parallel_size"]
    num_ratios = len(report["step_time_ratio_to_base"])
    width = 0.8 / max(1, num_ratios)
    for i, (tp, by_c) in enumerate(report["step_time_ratio_to_base"].items()):
        x = np.arange(len(concurrency)) + (i - (num_ratios - 1) / 2) * width  # centred on each tick
        bars = rax.bar(x, [by_c[str(c)] for c in concurrency], width, label=f"TP={tp} / TP={base}")
        for bar, c in zip(bars, concurrency, strict=True):
            rax.annotate(f"{by_c[str(c)]:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                         ha="center", va="bottom", fontsize=8)  # fmt: skip
    rax.axhline(1.0, color="black", lw=1, ls="--")
    rax.set_xticks(np.arange(len(concurrency)), [str(c) for c in concurrency])
    rax.set_xlabel("concurrent decoding requests")
    rax.set_ylabel("median step time ratio")
    rax.margins(y=0.2)
    rax.legend(fontsize=8)
    fig.suptitle(f"decode step time by tensor-parallel size ({report['machine']['cpu_model']})", fontsize=9)
    fig.tight_layout()
    path = out_dir / PLOT_NAME
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def format_report(report: dict) -> str:
    m = report["machine"]
    threads = ", ".join(f"TP={tp}: {e['torch_threads_per_rank']}" for tp, e in report["engines"].items())
    lines = [f"{m['cpu_model']}, {m['cpu_count']} CPUs; torch threads per rank {threads}"]
    cont = m["contention"]
    if cont.get("other_cpu_s") is not None:
        lines.append(
            f"other processes used {cont['other_cpu_s']:.1f} CPU-s ({cont['other_cpu_share']:.1%} of the "
            f"machine) and the hypervisor stole {cont['steal_s']:.1f} s over the {cont['wall_s']:.0f} s run"
        )
    lines.append(
        f"{'TP':>3}{'conc':>6}{'steps':>7}{'median ms':>11}{'p90 ms':>9}{'fwd ms':>9}{'other ms':>10}"
        f"{'tok/s':>9}{'comm B/step':>13}{'all-reduce B/tok':>18}{'vs base':>9}"
    )
    ratios = report["step_time_ratio_to_base"]
    for tp, by_c in report["results"].items():
        for c, r in by_c.items():
            ratio = f"{ratios[tp][c]:.2f}x" if tp in ratios else "-"
            lines.append(
                f"{tp:>3}{c:>6}{r['num_steps']:>7}{r['median_step_s'] * 1e3:>11.2f}{r['p90_step_s'] * 1e3:>9.2f}"
                f"{r['median_forward_s'] * 1e3:>9.2f}{r['median_other_s'] * 1e3:>10.2f}"
                f"{r['decode_tokens_per_s']:>9.0f}{r['mean_comm_bytes']:>13.0f}"
                f"{r['all_reduce_bytes_per_decode_token']:>18.0f}{ratio:>9}"
            )
    mismatched = [
        f"TP={tp} c={c}" for tp, by_c in report["results"].items() for c, r in by_c.items()
        if not r["comm_bytes_match_model"]
    ]  # fmt: skip
    if mismatched:
        lines.append("measured comm bytes differ from the layers' recipe at: " + ", ".join(mismatched))
    differ = [
        f"TP={tp} c={c}: {r['outputs_differing_from_first_size']}"
        for tp, by_c in report["results"].items() for c, r in by_c.items()
        if r["outputs_differing_from_first_size"]
    ]  # fmt: skip
    if differ:
        lines.append("greedy outputs differing from the first TP size (requests): " + "; ".join(differ))
    return "\n".join(lines)
