"""`mmserve bench kernels`: the Triton paged-attention kernel on a CUDA device, for decode batches
and mixed chunk+decode batches: median time, achieved bytes/s against the card's measured copy bandwidth,
and speed against torch SDPA over the same K/V gathered (unpaged)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mmserve.bench import KernelsBenchConfig, num, table


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


GPU_SHAPE = Shape(32, 8, 128, 16, torch.bfloat16)  # Llama-3-8B / Qwen2-7B-like attention, bf16
DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 16384)
# name -> (prefill chunks as (cached, new) tokens, (number of decodes, their context length))
MIXED: dict[str, tuple[list[tuple[int, int]], tuple[int, int]]] = {
    "chunk 512 @3.5k + 63 decodes @4k": ([(3584, 512)], (63, 4096)),
    "chunks 1k @0 + 1k @8k + 128 decodes @2k": ([(0, 1024), (8192, 1024)], (128, 2048)),
}
# The goal: decode at batch 64, context 4k, >= 70% of copy bandwidth and faster than SDPA.
GOAL_BATCH, GOAL_CONTEXT, GOAL_FRACTION = 64, 4096, 0.7


@dataclass
class Case:
    """One batch: decodes first, then prefill chunks; paged inputs plus the same K/V gathered for SDPA."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    query_start_loc: list[int]
    seq_lens: list[int]
    num_decodes: int
    decode_kv: tuple[torch.Tensor, torch.Tensor] | None  # [num_decodes, num_kv_heads, context, head_dim] each
    chunk_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per chunk [1, num_heads, seq_len, head_dim] (heads expanded)


def build_case(chunks: Sequence[tuple[int, int]], num_decodes: int, decode_context: int, shape: Shape,
               device: torch.device) -> Case:  # fmt: skip
    seqs = [(decode_context - 1, 1)] * num_decodes + list(chunks)
    bs = shape.block_size
    blocks_per_seq = [-(-(c + n) // bs) for c, n in seqs]
    num_blocks = sum(blocks_per_seq)
    kv_cache = torch.randn(2, num_blocks, bs, shape.num_kv_heads, shape.head_dim, device=device, dtype=shape.dtype)
    perm = torch.randperm(num_blocks, device=device)  # scattered physical blocks, as after many steps
    width = max(blocks_per_seq)
    block_tables = torch.zeros(len(seqs), width, dtype=torch.int64, device=device)
    start = 0
    for i, nb in enumerate(blocks_per_seq):
        block_tables[i, :nb] = perm[start : start + nb]
        start += nb
    query_start_loc, seq_lens = [0], []
    for cached, new in seqs:
        query_start_loc.append(query_start_loc[-1] + new)
        seq_lens.append(cached + new)
    query = torch.randn(query_start_loc[-1], shape.num_heads, shape.head_dim, device=device, dtype=shape.dtype)

    def gather(i: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences i..i+n-1 (same length): K, V as [n, num_kv_heads, seq_len, head_dim], contiguous."""
        seq_len = seq_lens[i]
        table = block_tables[i : i + n, : blocks_per_seq[i]]
        k, v = (kv_cache[j][table].flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous() for j in (0, 1))
        return k, v

    group = shape.num_heads // shape.num_kv_heads
    chunk_kv = []
    for i in range(num_decodes, len(seqs)):
        k, v = gather(i, 1)
        chunk_kv.append((k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    decode_kv = gather(0, num_decodes) if num_decodes else None
    return Case(query, kv_cache, block_tables, query_start_loc, seq_lens, num_decodes, decode_kv, chunk_kv)


def sdpa_baseline(case: Case, scale: float) -> Callable[[], torch.Tensor]:
    """SDPA over the gathered K/V: decodes batched with the query group as the query length (exact for
    GQA decode, no mask), each chunk with a bottom-right causal mask over its context."""
    from torch.nn.attention.bias import causal_lower_right

    _, num_heads, head_dim = case.query.shape
    b, starts = case.num_decodes, case.query_start_loc
    masks = [causal_lower_right(starts[i + 1] - starts[i], case.seq_lens[i]) for i in range(b, len(case.seq_lens))]

    def run() -> torch.Tensor:
        out = torch.empty_like(case.query)
        if case.decode_kv is not None:
            k, v = case.decode_kv
            q = case.query[:b].view(b, k.shape[1], num_heads // k.shape[1], head_dim)  # [b, kv_heads, group, D]
            out[:b] = F.scaled_dot_product_attention(q, k, v, scale=scale).reshape(b, num_heads, head_dim)
        for j, ((k, v), mask) in enumerate(zip(case.chunk_kv, masks, strict=True)):
            lo, hi = case.query_start_loc[b + j], case.query_start_loc[b + j + 1]
            q = case.query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, num_heads, n, head_dim]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            out[lo:hi] = o[0].transpose(0, 1)
        return out

    return run


def cuda_ms(fn: Callable[[], object]) -> float:
    """Median ms over repeats (CUDA events; triton flushes L2 between calls, hiding launch overhead)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def cpu_ms(fn: Callable[[], object], repeats: int = 3) -> float:
    """Smoke mode only: wall-clock median."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, timer: Callable[[Callable[[], object]], float], nbytes: int) -> float:
    """Bytes/s of one large device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def measure(name: str, case: Case, shape: Shape, copy_bw: float,
            timer: Callable[[Callable[[], object]], float]) -> dict[str, Any]:  # fmt: skip
    """One case's row of the report (`max_abs_diff`: the paged kernel's output against SDPA's)."""
    from mmserve.kernels import triton_attention

    scale = shape.head_dim**-0.5
    args = (case.query, case.kv_cache, case.block_tables, case.query_start_loc, case.seq_lens, scale)
    baseline = sdpa_baseline(case, scale)
    diff = (triton_attention.paged_attention(*args).float() - baseline().float()).abs().max().item()
    triton_ms, sdpa_ms = timer(lambda: triton_attention.paged_attention(*args)), timer(baseline)
    plan = triton_attention.launch_plan(case.query, case.kv_cache, case.query_start_loc, case.seq_lens)
    kv_bytes = sum(case.seq_lens) * 2 * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
    rate = kv_bytes / (triton_ms * 1e-3)
    return {"name": name, "num_seqs": len(case.seq_lens), "num_tokens": case.query.shape[0],  # query rows
            "max_context": max(case.seq_lens),
            "num_splits": plan.num_splits,  # 1: single pass; >1: split-KV partials + reduce
            "triton_ms": triton_ms, "sdpa_ms": sdpa_ms,
            "kv_bytes": kv_bytes,  # K/V bytes the batch must read at least once
            "triton_bytes_per_s": rate, "fraction_of_copy": rate / copy_bw,  # of the measured copy bandwidth
            "speedup_vs_sdpa": sdpa_ms / triton_ms,  # > 1: the paged kernel is faster
            "max_abs_diff": diff}  # fmt: skip


def bench_kernels(cfg: KernelsBenchConfig) -> dict:
    """Measures every case on the GPU (or, `smoke`, tiny cases on the CPU in Triton's interpreter)."""
    if cfg.smoke:
        # Must precede the first `import triton` (the kernels are imported lazily below).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, timer, copy_bytes = torch.device("cpu"), cpu_ms, 1 << 24
        shape, batches, contexts = Shape(4, 2, 16, 16, torch.float32), (1, 2), (64,)
        mixed = {"chunk 20 @30 + 2 decodes @40": ([(30, 20)], (2, 40))}
    elif torch.cuda.is_available():
        device, timer, copy_bytes = torch.device("cuda"), cuda_ms, 1 << 30
        shape, batches, contexts, mixed = GPU_SHAPE, DECODE_BATCHES, DECODE_CONTEXTS, MIXED
    else:
        raise ValueError("mmserve bench kernels needs a CUDA device (or --smoke to check the script on the CPU)")
    import triton

    copy_bw = copy_bandwidth(device, timer, copy_bytes)
    cases = [(f"decode b={b} ctx={c}", [], (b, c)) for c in contexts for b in batches]
    cases += [(f"mixed: {n}", chunks, decodes) for n, (chunks, decodes) in mixed.items()]
    results: list[dict[str, Any]] = []
    for case_name, chunks, (num_decodes, context) in cases:
        results.append(measure(case_name, build_case(chunks, num_decodes, context, shape, device), shape, copy_bw, timer))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the case's cache and tensors are gone: the next case has the memory
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter smoke run)"
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__, "copy_bytes_per_s": copy_bw,
            "shape": {**asdict(shape), "dtype": str(shape.dtype)}, "results": results}  # fmt: skip


def format_report(report: dict) -> str:
    """The device, the shape, a row per case, and whether the goal is met (when its case ran)."""
    shape, results = report["shape"], report["results"]
    lines = [f"device: {report['device']}; copy bandwidth {report['copy_bytes_per_s'] / 1e9:.0f} GB/s (read + write)",
             f"shape: {shape['num_heads']} q heads / {shape['num_kv_heads']} kv heads, head_dim {shape['head_dim']}, "
             f"block {shape['block_size']}, {shape['dtype'].removeprefix('torch.')}",
             table(("case", "splits", "triton ms", "sdpa ms", "GB/s", "of copy", "vs sdpa", "max|d|"), [
                 (r["name"], r["num_splits"], num(r["triton_ms"], ".4f"), num(r["sdpa_ms"], ".4f"),
                  num(r["triton_bytes_per_s"] / 1e9, ".0f"), num(r["fraction_of_copy"], ".0%"),
                  num(r["speedup_vs_sdpa"], ".2f") + "x", num(r["max_abs_diff"], ".1e")) for r in results])]  # fmt: skip
    if goal := next((r for r in results if r["name"] == f"decode b={GOAL_BATCH} ctx={GOAL_CONTEXT}"), None):
        met = goal["fraction_of_copy"] >= GOAL_FRACTION and goal["speedup_vs_sdpa"] > 1
        lines.append(f"goal (b={GOAL_BATCH}, ctx={GOAL_CONTEXT}: >= {GOAL_FRACTION:.0%} of copy bandwidth and faster "
                     f"than SDPA): {'met' if met else 'NOT met'}")  # fmt: skip
    return "\n".join(lines)
