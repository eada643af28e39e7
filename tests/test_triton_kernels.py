"""The Triton kernels against their torch twins: shuffled physical blocks, mid-block chunks, ragged batches
of decodes and chunks, GQA/MQA, head and block sizes, dtypes, non-contiguous inputs, the split-KV path, and
one greedy run of a tiny model. Without CUDA they run in Triton's interpreter (tiny shapes: it is slow)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # importing it here would be too early: see below
    pytest.skip("triton is not installed", allow_module_level=True)


def _kernels_runnable_here() -> bool:
    """Natively on CUDA; else in Triton's interpreter, which needs TRITON_INTERPRET=1 before the first
    `import triton` (it decorates triton's own library then). In the full suite something imports triton
    earlier (transformers, via torch._dynamo): then `test_kernels_in_a_fresh_interpreter_process` runs
    this module again in a subprocess."""
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    from mmserve.kernels import triton_attention

    usable = triton_attention.CONSISTENT
    return usable and (triton_attention.INTERPRETED or torch.cuda.is_available())


IN_PROCESS = _kernels_runnable_here()

from mmserve import LLM, SamplingParams  # noqa: E402
from mmserve.kernels import cpu_attention, reference, triton_attention, triton_cache  # noqa: E402
from mmserve.kernels.dispatch import get_attention_backend  # noqa: E402

kernels_here = pytest.mark.skipif(
    not IN_PROCESS, reason="triton was imported compiled: run by test_kernels_in_a_fresh_interpreter_process"
)
DEVICE = torch.device("cpu" if triton_attention.INTERPRETED or not torch.cuda.is_available() else "cuda")
# The interpreter's bf16 tl.dot is wrong (the kernels cast to fp32 there): bf16 is checked natively only.
DTYPES = [torch.float32, torch.float16] + ([] if DEVICE.type == "cpu" else [torch.bfloat16])
# fp32: both sides exact on the CPU; on a GPU the reference's SDPA kernels sum in other orders.
TOLERANCE = {torch.float32: 1e-5 if DEVICE.type == "cpu" else 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}

# (tokens already cached, tokens new this step): decodes, chunks starting/ending mid-block, a fresh prefill,
# a block-aligned chunk, a chunk spanning several blocks.
RAGGED = [(0, 1), (5, 1), (17, 1), (3, 9), (0, 23), (16, 16), (30, 2), (20, 27)]
DECODES = [(0, 1), (7, 1), (40, 1), (63, 1), (15, 1)]


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim], a view of a fused qkv tensor
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], non-contiguous view
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], non-contiguous view
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim], context already stored
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    query_start_loc: list[int]
    seq_lens: list[int]


def make_batch(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_needed) + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled physical blocks
    tables, slots, query_start_loc, seq_lens = [], [], [0], []
    for (cached, new), nb in zip(seqs, blocks_needed, strict=True):
        blocks = [free.pop() for _ in range(nb)]
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
        query_start_loc.append(query_start_loc[-1] + new)
        seq_lens.append(cached + new)
    width = max(len(b) for b in tables)
    num_tokens = query_start_loc[-1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(
        DEVICE, dtype
    )  # the fused projection
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)  # views: moved before splitting
    return Batch(
        query=query.view(num_tokens, num_heads, head_dim),
        key=key.view(num_tokens, num_kv_heads, head_dim),
        value=value.view(num_tokens, num_kv_heads, head_dim),
        kv_cache=kv_cache.to(dtype).to(DEVICE),
        slot_mapping=torch.tensor(slots, device=DEVICE),
        block_tables=torch.tensor([b + [0] * (width - len(b)) for b in tables], device=DEVICE),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
    )


@kernels_here
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_cache_matches_reference(dtype: torch.dtype, block_size: int) -> None:
    batch = make_batch(RAGGED, 4, 2, 16, block_size, dtype)
    assert not batch.key.is_contiguous() and not batch.value.is_contiguous()
    expected = batch.kv_cache.clone()
    reference.store_kv_cache(batch.key, batch.value, expected, batch.slot_mapping)
    triton_cache.store_kv_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    assert torch.equal(batch.kv_cache, expected)


@kernels_here
def test_store_kv_cache_casts_to_the_cache_dtype() -> None:
    batch = make_batch(DECODES, 2, 2, 16, 16, torch.float16)
    key, value = batch.key.float(), batch.value.float()
    expected = batch.kv_cache.clone()
    reference.store_kv_cache(key, value, expected, batch.slot_mapping)
    triton_cache.store_kv_cache(key, value, batch.kv_cache, batch.slot_mapping)
    assert torch.equal(batch.kv_cache, expected)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


@kernels_here
@pytest.mark.parametrize("fp8_dtype", FP8, ids=FP8_IDS)
def test_encode_fp8_is_torchs_cast_bit_for_bit(fp8_dtype: torch.dtype) -> None:
    """Every code's value, the midpoints between neighbours (ties to even, both signs), subnormals, zero,
    values past the largest finite one (saturated) and random ones: the store kernel writes what the
    reference's cast writes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()
    finite = codes[codes.isfinite()].unique()  # sorted
    mids = (finite[1:] + finite[:-1]) / 2
    limit = torch.finfo(fp8_dtype).max
    extra = torch.tensor([0.0, limit * 1.01, limit * 1.07, 1e30, 1e-30, -1e-30])
    values = torch.cat([finite, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), extra, torch.randn(512) * 50])
    num = -(-values.numel() // 4) * 4
    values = torch.cat([values, torch.zeros(num - values.numel())]).view(-1, 1, 4)  # [tokens, 1 head, 4]
    scales = torch.ones(2, 1)
    expected = torch.zeros(2, num // 4, 1, 1, 4, dtype=fp8_dtype)  # one token per block
    got = expected.clone()
    slots = torch.arange(num // 4)
    reference.store_kv_cache(values, -values, expected, slots, scales)
    triton_cache.store_kv_cache(values, -values, got, slots, scales)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@kernels_here
@pytest.mark.parametrize("fp8_dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize(("dtype", "num_splits"), [(torch.float32, None), (torch.float16, None), (torch.float32, 3)])
def test_fp8_cache_store_and_attention_match_reference(
    fp8_dtype: torch.dtype, dtype: torch.dtype, num_splits: int | None
) -> None:
    """An FP8 cache with per-head scales: the Triton store writes the reference's codes, and attention over
    them (decodes and chunks, single pass and split) equals the reference's."""
    batch = make_batch(RAGGED, 4, 2, 32, 16, dtype, seed=2)
    kv_scales = torch.tensor([[0.5, 2.0], [0.125, 4.0]], device=DEVICE)
    # The context before this step as codes: values of randn's size once scaled back, K and V of each head.
    kv_cache = (batch.kv_cache.float() / kv_scales[:, None, None, :, None]).to(fp8_dtype)
    expected = kv_cache.clone()
    reference.store_kv_cache(batch.key, batch.value, expected, batch.slot_mapping, kv_scales)
    triton_cache.store_kv_cache(batch.key, batch.value, kv_cache, batch.slot_mapping, kv_scales)
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))
    args = (batch.query, kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, 32**-0.5)
    out = triton_attention.paged_attention_with(*args, kv_scales=kv_scales, num_splits=num_splits, block_n=16)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, reference.paged_attention(*args, kv_scales), atol=tol, rtol=tol)


# (num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits, block_n, seqs)
CASES = [
    (4, 2, 16, 16, torch.float32, None, None, RAGGED),  # GQA
    (4, 4, 16, 32, torch.float32, None, None, RAGGED),  # MHA
    (4, 1, 16, 16, torch.float16, None, None, RAGGED),  # MQA
    (8, 2, 16, 32, torch.float16, None, 16, RAGGED),
    (8, 2, 16, 16, torch.float32, None, None, DECODES),  # decode-only: the small tile
    (2, 1, 64, 16, torch.float16, None, None, RAGGED[-3:]),
    (2, 2, 80, 32, torch.float32, None, None, RAGGED[:4]),
    (4, 2, 96, 16, torch.float16, None, 32, DECODES),
    (2, 1, 128, 16, torch.float32, None, None, RAGGED[3:6]),
    (6, 2, 16, 16, torch.float32, None, None, RAGGED),  # a group of 3 heads: padded tile rows
    # The split-KV path forced on: several BLOCK_N shares per sequence, some empty for short ones.
    (4, 2, 16, 16, torch.float32, 3, 16, RAGGED),
    (8, 2, 16, 32, torch.float16, 2, 16, DECODES),
    (4, 1, 16, 16, torch.float32, 4, 16, [(70, 1), (2, 1), (40, 13)]),
    (6, 2, 16, 32, torch.float16, 3, 16, RAGGED[2:]),
]


@kernels_here
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size", "dtype", "num_splits", "block_n", "seqs"), CASES
)
def test_paged_attention_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int | None,
    block_n: int | None,
    seqs: list[tuple[int, int]],
) -> None:
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype)
    reference.store_kv_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    args = (batch.query, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens)
    scale = head_dim**-0.5
    expected = reference.paged_attention(*args, scale)
    out = triton_attention.paged_attention_with(*args, scale, num_splits=num_splits, block_n=block_n)
    assert out.shape == expected.shape and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@kernels_here
@pytest.mark.parametrize("dtype", DTYPES)
def test_default_path_matches_reference(dtype: torch.dtype) -> None:
    """The public twin, with the split decision left to the kernel (never split in the interpreter)."""
    batch = make_batch(RAGGED, 4, 2, 32, 16, dtype, seed=1)
    triton_cache.store_kv_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    args = (batch.query, batch.kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, 0.3)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(
        triton_attention.paged_attention(*args), reference.paged_attention(*args), atol=tol, rtol=tol
    )


def test_split_kv_is_chosen_only_for_small_grids_with_long_contexts() -> None:
    choose = triton_attention.choose_num_splits
    assert choose(8, 16384, None) == 1  # no SM count (interpreter): never split
    assert choose(8, 16384, 132) == 64  # batch 1, 8 KV heads, 16k context: capped
    assert choose(16 * 8, 4096, 132) == 9
    assert choose(64 * 8, 4096, 132) == 3  # under a few programs per SM: a tail-heavy grid
    assert choose(256 * 8, 4096, 132) == 1  # the plain grid already fills the card
    assert choose(8, 300, 132) == 1  # too short to share


def test_launch_plan_tiles_and_orders_work() -> None:
    cpu = torch.device("cpu")
    plan = triton_attention.make_launch_plan((0, 1, 2), (5, 90), cpu, 4, 2, None)
    assert (plan.block_m, plan.block_q, plan.num_splits) == (16, 4, 1)  # decode-only: the small tile
    assert plan.work_seq.tolist() == [1, 0]  # the longer key range first
    plan = triton_attention.make_launch_plan((0, 1, 40), (5, 90), cpu, 4, 2, None)
    assert (plan.block_m, plan.block_q, plan.num_work) == (64, 16, 1 + 3)


@kernels_here
def test_dispatch_honours_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_ATTENTION_BACKEND", "triton")
    backend = get_attention_backend(DEVICE)
    assert backend.name == "triton" and backend.paged_attention is triton_attention.paged_attention
    monkeypatch.setenv("MMSERVE_ATTENTION_BACKEND", "torch")
    assert get_attention_backend(DEVICE).paged_attention is reference.paged_attention
    monkeypatch.setenv("MMSERVE_ATTENTION_BACKEND", "cuda-graphs")
    with pytest.raises(ValueError, match="not available"):
        get_attention_backend(DEVICE)
    monkeypatch.delenv("MMSERVE_ATTENTION_BACKEND")
    on_cpu = "cpu" if cpu_attention.load() is not None else "torch"  # the C decode kernel where it builds
    assert get_attention_backend(DEVICE).name == (on_cpu if DEVICE.type == "cpu" else "triton")


@kernels_here
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_greedy_tokens_match_the_torch_backend(
    arch: str, tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget of 16 tokens chunks the longer prompt, so steps mix prefill chunks with decodes. Qwen3-MoE:
    its head_dim (twice hidden / heads) through the attention kernels and its experts through the MoE one."""
    model_dir = tiny_model_dir(arch)
    prompts = [list(range(100, 130)), list(range(200, 209)), [300]]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    tokens = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("MMSERVE_ATTENTION_BACKEND", name)
        monkeypatch.setenv("MMSERVE_MOE_BACKEND", name)
        llm = LLM(model_dir, device=DEVICE.type, dtype="float32", max_num_batched_tokens=16, num_kv_blocks=16)
        assert llm.engine.info().attention_backend == name
        tokens[name] = [out.token_ids for out in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.skipif(IN_PROCESS, reason="the kernels run in this process")
def test_kernels_in_a_fresh_interpreter_process() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())]
    done = subprocess.run(
        cmd, cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" in done.stdout  # only this test is skipped there
