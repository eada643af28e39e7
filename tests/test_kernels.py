"""The paged-attention kernels of the CPU (the torch reference and the C decode kernel) against dense
causal attention, on shuffled physical blocks, chunks that start and end mid-block, ragged batches mixing
decodes and chunks, and GQA; the C kernel's build, cache and fall-back."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmserve.kernels import cpu_attention, fp8, reference

C_KERNEL = cpu_attention.load() is not None
IMPLEMENTATIONS = {
    "reference": reference.paged_attention,
    "c-kernel": pytest.param(
        cpu_attention.paged_attention, marks=pytest.mark.skipif(not C_KERNEL, reason="no C compiler")
    ),
}


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [num_q, H, D] (the last num_q positions); k, v: [seq_len, Hkv, D]. Plain causal attention."""
    num_q, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(seq_len - num_q, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, -1), v.double()).to(q.dtype)


@pytest.mark.parametrize("paged_attention", list(IMPLEMENTATIONS.values()), ids=list(IMPLEMENTATIONS))
@pytest.mark.parametrize("head_dim", [16, 64, 128])  # the C kernel has unrolled copies for 64 and 128
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (4, 1)])
def test_paged_attention_matches_dense(
    paged_attention: Callable[..., torch.Tensor],
    head_dim: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    torch.manual_seed(0)
    num_blocks = 512
    # (cached tokens before this step, new tokens this step): decodes, mid-block chunks, a fresh prefill,
    # and long decodes that land in another padded group than the short ones.
    seqs = [(0, 1), (5, 1), (17, 1), (3, 9), (0, 23), (block_size, block_size), (30, 2), (300, 1), (600, 1)]
    decode_lens = [c + n for c, n in seqs if n == 1]
    assert len(reference._length_buckets(decode_lens)) == 2
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    free = torch.randperm(num_blocks).tolist()  # shuffled physical blocks
    block_tables, keys, values, queries, slots = [], [], [], [], []
    query_start_loc, seq_lens = [0], []
    for cached, new in seqs:
        seq_len = cached + new
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        block_tables.append(blocks)
        k = torch.randn(seq_len, num_kv_heads, head_dim)
        v = torch.randn(seq_len, num_kv_heads, head_dim)
        for pos in range(cached):  # context already in the cache
            kv_cache[0, blocks[pos // block_size], pos % block_size] = k[pos]
            kv_cache[1, blocks[pos // block_size], pos % block_size] = v[pos]
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, seq_len)]
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(new, num_heads, head_dim))
        query_start_loc.append(query_start_loc[-1] + new)
        seq_lens.append(seq_len)
    width = max(len(b) for b in block_tables)
    table = torch.tensor([b + [0] * (width - len(b)) for b in block_tables])
    new_k = torch.cat([k[c:] for k, (c, _) in zip(keys, seqs, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(values, seqs, strict=True)])
    # Non-contiguous inputs, as the qkv split produces them.
    new_k = torch.cat([new_k, new_k], dim=-1)[..., :head_dim]
    assert not new_k.is_contiguous()
    reference.store_kv_cache(new_k, new_v, kv_cache, torch.tensor(slots))
    query = torch.cat(queries)
    scale = head_dim**-0.5
    out = paged_attention(query, kv_cache, table, query_start_loc, seq_lens, scale)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        expected = dense_attention(query[start:end], k, v, scale)
        torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scores_per_tile", [1, 8 * 90 * 5, 1 << 22])  # 1 row a tile, 5 (the last 2), all
def test_chunk_attention_tiles_match_dense(scores_per_tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk of 37 rows after 53 cached tokens: however its rows are tiled, each tile seeing keys up to
    its last row only, the result is dense causal attention's."""
    monkeypatch.setattr(reference, "_SCORES_PER_TILE", scores_per_tile)
    torch.manual_seed(2)
    query, key, value = torch.randn(37, 8, 32), torch.randn(90, 2, 32), torch.randn(90, 2, 32)
    got = reference._chunk_attention(query, key, value, 32**-0.5)
    torch.testing.assert_close(got, dense_attention(query, key, value, 32**-0.5), atol=1e-5, rtol=1e-5)


def cached_sequence(
    key: torch.Tensor, value: torch.Tensor, block_size: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K/V [seq_len, num_kv_heads, head_dim] stored in shuffled blocks of a fresh cache: (the cache
    [2, num_blocks, block_size, num_kv_heads, head_dim], the sequence's block ids)."""
    seq_len = key.shape[0]
    kv_cache = torch.zeros(2, num_blocks, block_size, *key.shape[1:], dtype=key.dtype)
    blocks = torch.randperm(num_blocks)[: -(-seq_len // block_size)]
    slots = torch.tensor([int(blocks[p // block_size]) * block_size + p % block_size for p in range(seq_len)])
    reference.store_kv_cache(key, value, kv_cache, slots)
    return kv_cache, blocks


def test_a_long_fp32_chunk_after_a_short_head_is_padded_causal_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long fp32 chunk after a few cached tokens (a long prompt after a prefix-cached chat template head) goes
    through the flash kernel as causal attention over zero-padded queries; the result is dense attention's, and the
    shapes outside the rule keep the batched products."""
    monkeypatch.setattr(reference, "_PAD_MIN_ROWS", 40)
    torch.manual_seed(4)
    block_size, num_blocks, cached, new = 16, 16, 21, 60
    seq_len = cached + new
    query = torch.randn(new, 8, 64)
    key, value = torch.randn(seq_len, 2, 64), torch.randn(seq_len, 2, 64)
    kv_cache, blocks = cached_sequence(key, value, block_size, num_blocks)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = reference.paged_attention(query, kv_cache, blocks[None], [0, new], [seq_len], 0.125)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in {event.name for event in prof.events()}
    torch.testing.assert_close(out, dense_attention(query, key, value, 0.125), atol=1e-5, rtol=1e-5)
    assert reference._pads_to_causal(torch.float32, 40, 80)
    assert not reference._pads_to_causal(torch.float32, 39, 60)  # too few rows
    assert not reference._pads_to_causal(torch.float32, 40, 81)  # more cached than new
    assert not reference._pads_to_causal(torch.bfloat16, 40, 60)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fresh_prefill_takes_sdpas_flash_kernel(dtype: torch.dtype) -> None:
    """A prefill with nothing cached before it is plain causal attention, and SDPA's flash kernel computes it
    (a 3-D call, without the batch dimension, fell back to the math path: the whole [heads, seq_len, seq_len]
    scores and mask); the result is dense attention's."""
    torch.manual_seed(3)
    block_size, num_blocks, seq_len = 16, 16, 97
    query = torch.randn(seq_len, 8, 64, dtype=dtype)
    key, value = torch.randn(seq_len, 2, 64, dtype=dtype), torch.randn(seq_len, 2, 64, dtype=dtype)
    kv_cache, blocks = cached_sequence(key, value, block_size, num_blocks)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = reference.paged_attention(query, kv_cache, blocks[None], [0, seq_len], [seq_len], 0.125)
    ops = {event.name for event in prof.events()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, dense_attention(query, key, value, 0.125), atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(not C_KERNEL, reason="no C compiler")
def test_c_kernel_leaves_what_it_does_not_cover_to_the_reference() -> None:
    """fp64 queries and batches without decodes go to the reference whole; a mixed batch's prefill
    rows too, so they equal the reference's bit for bit."""
    torch.manual_seed(1)
    kv_cache = torch.randn(2, 16, 4, 2, 64)
    table = torch.arange(16).view(2, 8)
    query = torch.randn(12, 8, 64)
    query_start_loc, seq_lens = [0, 11, 12], [20, 30]
    expected = reference.paged_attention(query, kv_cache, table, query_start_loc, seq_lens, 0.125)
    got = cpu_attention.paged_attention(query, kv_cache, table, query_start_loc, seq_lens, 0.125)
    assert torch.equal(got[:11], expected[:11])  # the prefill chunk: the reference's own rows
    torch.testing.assert_close(got[11:], expected[11:], atol=1e-5, rtol=1e-5)  # the decode: the kernel
    for q, kv in ((query.double(), kv_cache.double()), (query[:11], kv_cache)):
        loc = [0, 11] if q.shape[0] == 11 else query_start_loc
        lens = seq_lens[: len(loc) - 1]
        assert torch.equal(
            cpu_attention.paged_attention(q, kv, table, loc, lens, 0.125),
            reference.paged_attention(q, kv, table, loc, lens, 0.125),
        )


@pytest.mark.skipif(not C_KERNEL, reason="no C compiler")
def test_c_kernel_takes_bf16_queries_and_caches_in_fp32() -> None:
    """bf16 queries over a bf16 (or FP8) cache: widened to fp32 exactly, attended in fp32, rounded once, so
    the result is the fp32 kernel's over the same values, rounded to bf16; a mixed batch's prefill rows are
    still the reference's (in bf16), and everything is within bf16's rounding of the fp32 reference."""
    torch.manual_seed(3)
    kv_cache = torch.randn(2, 16, 4, 2, 64).bfloat16()
    table = torch.arange(16).view(2, 8)
    query = torch.randn(12, 8, 64).bfloat16()
    loc, lens = [0, 11, 12], [20, 30]
    got = cpu_attention.paged_attention(query, kv_cache, table, loc, lens, 0.125)
    assert got.dtype == torch.bfloat16
    widened = cpu_attention.paged_attention(query.float(), kv_cache.float(), table, loc, lens, 0.125)
    assert torch.equal(got[11:], widened[11:].bfloat16())
    assert torch.equal(got[:11], reference.paged_attention(query, kv_cache, table, loc, lens, 0.125)[:11])
    exact = reference.paged_attention(query.float(), kv_cache.float(), table, loc, lens, 0.125)
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=2e-2)
    codes = kv_cache.float().to(torch.float8_e4m3fn)
    scales = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    on_fp8 = cpu_attention.paged_attention(query[11:], codes, table[1:], [0, 1], [30], 0.125, scales)
    widened = cpu_attention.paged_attention(query[11:].float(), codes, table[1:], [0, 1], [30], 0.125, scales)
    assert on_fp8.dtype == torch.bfloat16 and torch.equal(on_fp8, widened.bfloat16())


@pytest.mark.skipif(not C_KERNEL, reason="no C compiler")
@pytest.mark.parametrize("num_decodes", [1, 3, 4, 9])  # below 2 per thread: one KV head per work item
@pytest.mark.parametrize("num_threads", [1, 2])
def test_c_kernel_work_split_matches_the_reference(num_decodes: int, num_threads: int) -> None:
    torch.manual_seed(num_decodes)
    kv_cache = torch.randn(2, 64, 16, 2, 48)
    table = torch.randperm(64)[: num_decodes * 4].view(num_decodes, 4)
    seq_lens = torch.randint(1, 64, (num_decodes,)).tolist()
    query = torch.randn(num_decodes, 8, 48)
    loc = list(range(num_decodes + 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        got = cpu_attention.paged_attention(query, kv_cache, table, loc, seq_lens, 0.2)
    finally:
        torch.set_num_threads(threads)
    expected = reference.paged_attention(query, kv_cache, table, loc, seq_lens, 0.2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def python_with_kernel_cache(code: str, cache: Path, backend_env: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh Python whose C kernels build into (or load from) `cache`, with $CC and `backend_env`
    unset unless given in `env`: what a new process on this machine would pick."""
    environ = {k: v for k, v in os.environ.items() if k not in ("CC", backend_env)}
    return subprocess.run([sys.executable, "-c", code], env={**environ, "MMSERVE_KERNEL_CACHE": str(cache), **env},
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def _backend_in_a_fresh_process(cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import torch\n"
        "from mmserve.kernels import cpu_attention, dispatch\n"
        "print(cpu_attention.load() is not None, dispatch.get_attention_backend(torch.device('cpu')).name)\n"
        # Loading the library must leave the process's float state alone (no flush-to-zero of denormals).
        "print((torch.tensor([1e-39]) * 1.0).item() != 0.0)\n"
    )
    return python_with_kernel_cache(code, cache, "MMSERVE_ATTENTION_BACKEND", **env)


@pytest.mark.skipif(not C_KERNEL, reason="no C compiler")
def test_c_kernel_is_built_once_and_without_a_compiler_dispatch_keeps_the_reference(tmp_path: Path) -> None:
    built = _backend_in_a_fresh_process(tmp_path / "a")
    assert built.stdout.split() == ["True", "cpu", "True"], built.stderr
    (library,) = (tmp_path / "a").glob("paged_decode_attention-*.so")
    stamp = library.stat().st_mtime_ns
    # The cached library loads without compiling again.
    assert _backend_in_a_fresh_process(tmp_path / "a").stdout.split() == ["True", "cpu", "True"]
    assert library.stat().st_mtime_ns == stamp
    # No working compiler and nothing cached: the reference, with one warning that says why.
    fallback = _backend_in_a_fresh_process(tmp_path / "b", CC="false")
    assert fallback.stdout.split() == ["False", "torch", "True"], fallback.stderr
    assert "C kernel paged_decode_attention unavailable" in fallback.stderr
    assert not list((tmp_path / "b").glob("*.so"))  # nothing half-built left behind
    forced = _backend_in_a_fresh_process(tmp_path / "b", CC="false", MMSERVE_ATTENTION_BACKEND="cpu")
    assert forced.returncode != 0 and "could not be built" in forced.stderr


def test_store_kv_cache_writes_only_the_given_slots() -> None:
    kv_cache = torch.zeros(2, 4, 2, 1, 3)
    key, value = torch.ones(2, 1, 3), torch.full((2, 1, 3), 2.0)
    reference.store_kv_cache(key, value, kv_cache, torch.tensor([5, 0]))
    assert kv_cache[0, 2, 1].eq(1).all() and kv_cache[1, 0, 0].eq(2).all()
    assert kv_cache.count_nonzero() == 2 * 2 * 3


@pytest.mark.parametrize("rows", [1, 64, 300])
def test_rms_norm_fused_fp32_path_matches_transformers_formula(rows: int) -> None:
    """RMSNorm takes F.rms_norm for fp32 input; the result equals Qwen2RMSNorm's steps (bf16 input keeps
    the explicit steps: normalise in fp32, cast back, then the weight)."""
    from mmserve.models.decoder import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = torch.randn(rows, 96) * 3
    expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-6)
    xb, nb = x.bfloat16(), norm.bfloat16()
    expected_bf16 = (
        nb.weight * (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    )
    assert torch.equal(nb(xb), expected_bf16)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 4, 64, 128, 129, 300])
def test_linear_cpu_transposed_product_matches_f_linear(rows: int, bias: bool) -> None:
    """The decoder's Linear runs few-row products as (W @ x^T)^T on the CPU; same result as F.linear
    (a column-major view for those rows: callers must not rely on contiguity)."""
    from mmserve.models.parallel import Linear

    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    out = layer(x)
    assert out.shape == (rows, 160)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


# -- FP8 KV cache ---------------------------------------------------------------------------------------------


def _fp8_batch(
    dtype: torch.dtype, kv_scales: torch.Tensor, head_dim: int = 64, block_size: int = 16
) -> tuple[torch.Tensor, tuple, list[tuple[torch.Tensor, torch.Tensor]]]:
    """An FP8 cache written by store_kv_cache for decodes and chunks over shuffled blocks; returns the cache,
    the attention arguments after the cache, and each sequence's K/V as the cache holds them (quantized,
    decoded, scaled), which is what attention must read."""
    torch.manual_seed(3)
    num_heads, num_kv_heads, num_blocks = 8, kv_scales.shape[1], 128
    seqs = [(0, 1), (37, 1), (300, 1), (5, 12), (0, 20), (16, 16)]  # (cached, new)
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    free = torch.randperm(num_blocks).tolist()
    tables, held, queries, loc, lens = [], [], [], [0], []
    for cached, new in seqs:
        seq_len = cached + new
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        # per-head magnitudes far apart, as real K/V are: one scale per head matters
        k = torch.randn(seq_len, num_kv_heads, head_dim) * kv_scales[0][:, None] * 3
        v = torch.randn(seq_len, num_kv_heads, head_dim) * kv_scales[1][:, None] * 3
        reference.store_kv_cache(k, v, kv_cache, slots, kv_scales)
        held.append(tuple(fp8.dequantize(fp8.quantize(t, kv_scales[i], dtype), kv_scales[i], torch.float32)
                          for i, t in enumerate((k, v))))  # fmt: skip
        tables.append(blocks)
        queries.append(torch.randn(new, num_heads, head_dim))
        loc.append(loc[-1] + new)
        lens.append(seq_len)
    width = max(map(len, tables))
    table = torch.tensor([b + [0] * (width - len(b)) for b in tables])
    return kv_cache, (torch.cat(queries), kv_cache, table, loc, lens, head_dim**-0.5, kv_scales), held


@pytest.mark.parametrize("paged_attention", list(IMPLEMENTATIONS.values()), ids=list(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_cache_attention_reads_what_was_stored(paged_attention: Callable[..., torch.Tensor], dtype: torch.dtype) -> None:
    """Over an FP8 cache with per-head scales, attention equals dense attention over the K/V the cache
    holds (decoded and scaled) to fp32 rounding, for decodes and chunks (heads' scales 16-32x apart: a
    mix-up of heads or of K and V scales shows)."""
    kv_scales = torch.tensor([[0.5, 4.0], [0.25, 8.0]])
    kv_cache, args, held = _fp8_batch(dtype, kv_scales)
    assert kv_cache.dtype == dtype and kv_cache.float().isfinite().all()
    out = paged_attention(*args)
    query, loc, scale = args[0], args[3], args[5]
    for i, (k, v) in enumerate(held):
        expected = dense_attention(query[loc[i] : loc[i + 1]], k, v, scale)
        torch.testing.assert_close(out[loc[i] : loc[i + 1]], expected, atol=1e-4, rtol=1e-4)


def test_fp8_cache_holds_k_and_v_divided_by_their_head_scale() -> None:
    kv_cache = torch.zeros(2, 2, 2, 2, 4, dtype=torch.float8_e4m3fn)
    key = torch.tensor([1.0, 2.0, 3.0, 1000.0]).expand(1, 2, 4)
    value = torch.tensor([-1.0, 0.5, 0.0, -1000.0]).expand(1, 2, 4)
    scales = torch.tensor([[1.0, 2.0], [0.5, 1.0]])
    reference.store_kv_cache(key, value, kv_cache, torch.tensor([3]), scales)
    assert kv_cache[0, 1, 1].float().tolist() == [[1.0, 2.0, 3.0, 448.0], [0.5, 1.0, 1.5, 448.0]]  # saturated
    assert kv_cache[1, 1, 1].float().tolist() == [[-2.0, 1.0, 0.0, -448.0], [-1.0, 0.5, 0.0, -448.0]]
    assert kv_cache.float()[:, :, 0].abs().sum() == 0 and kv_cache.float()[:, 0].abs().sum() == 0
    e5m2 = fp8.quantize(torch.full((1, 1, 2), 1e6), torch.ones(1), torch.float8_e5m2)
    assert e5m2.float().tolist() == [[[57344.0, 57344.0]]]  # not inf


@pytest.mark.parametrize("dtype", fp8.FP8_DTYPES, ids=["e4m3", "e5m2"])
def test_fp8_byte_table_decodes_every_code(dtype: torch.dtype) -> None:
    table = fp8.byte_table(dtype)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    torch.testing.assert_close(table, codes.float(), equal_nan=True)
    assert fp8.KV_CACHE_DTYPES["fp8"] is torch.float8_e4m3fn and fp8.kv_cache_dtype_name(dtype).startswith("fp8_")
