"""Triton twin of `reference.paged_attention`: causal attention of a varlen batch mixing prefill chunks and
decodes over the paged KV cache, in one launch (GQA/MQA), plus a split-KV (flash-decoding) path with a
reduce launch for long contexts at small batch. An FP8 cache's codes are decoded in the kernel
(`decode_fp8`, exact, with integer ops that compile for every arch) and its per-head scales folded into the
scores (K) and the output (V). Knows the cache layout and the batch lists, not the model."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from mmserve.kernels import fp8
from mmserve.kernels.launch_plan import LaunchPlan

# Query-tile rows (tokens x heads of a KV group): the smallest `tl.dot` M for pure-decode launches, a larger
# one when any sequence brings a chunk (fp32 on a GPU keeps the small one: its exact dots spill otherwise).
_DECODE_BLOCK_M = 16
_CHUNK_BLOCK_M = 64
# Split-KV (flash-decoding): when the plain grid has fewer than `_SPLIT_PROGRAMS_PER_SM` programs per SM,
# split each tile's keys into shares of at least `_MIN_SPLIT_KV` keys (the reduce then reads a few MB at
# most, next to the cache's GBs), at most `_MAX_SPLITS` of them. Untuned guesses until measured on a GPU.
_SPLIT_PROGRAMS_PER_SM = 8
_MIN_SPLIT_KV = 256
_MAX_SPLITS = 64
_LOG2E = 1.4426950408889634


@triton.jit
def decode_fp8(codes, E4M3: tl.constexpr):
    """uint8 codes of e4m3fn (E4M3) or e5m2 -> their fp32 values, through fp16's bit layout: e5m2 is the
    top byte of an fp16; e4m3's exponent and mantissa shifted into fp16's read 2^-8 of the value (subnormals
    included), which the product by 256 restores exactly."""
    b = codes.to(tl.int32)
    if E4M3:
        half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        return half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return (b << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_attention_kernel(
    out_ptr,  # SPLIT: [num_tokens, num_heads, num_splits, head_dim] fp32 partial sums; else [num_tokens, num_heads, head_dim]
    max_ptr,  # SPLIT only: [num_tokens, num_heads, num_splits] fp32 running max (log2 units)
    sum_ptr,  # SPLIT only: [num_tokens, num_heads, num_splits] fp32 softmax denominators
    q_ptr,  # [num_tokens, num_heads, head_dim], any strides
    k_cache_ptr,  # kv_cache[0]: [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # kv_cache[1]: same strides as k_cache
    kv_scales_ptr,  # KV_FP8 only: [2, num_kv_heads] fp32 (K, V)
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int64
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    work_seq_ptr,  # [num_work] int32: sequence of each query tile
    work_tile_ptr,  # [num_work] int32: index of the tile among that sequence's query rows
    scale_log2,  # softmax scale * log2(e): scores are kept in log2 units for exp2
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    num_splits,  # a runtime value, so batch-dependent split counts never recompile
    HEAD_DIM: tl.constexpr,  # a constant, so the d-mask folds away and loads vectorize
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # rows of the query tile: BLOCK_Q tokens x GROUP heads, padded to a power of two
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= head_dim
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    SPLIT: tl.constexpr,  # False: write the normalized output; True: write partials for the reduce
    DOT_FP32: tl.constexpr,  # fp32 operands in exact ("ieee", not tf32) dots; see _exact_fp32
    KV_FP8: tl.constexpr,  # 0: the cache holds the compute dtype; 1: e4m3fn codes; 2: e5m2 codes (uint8 views)
):
    # Grid: (num_work, num_kv_heads, num_splits). A program owns BLOCK_Q query tokens of one sequence and
    # all GROUP query heads sharing one KV head, so each K/V tile is loaded once for the whole group.
    work = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(work_seq_ptr + work)
    tile = tl.load(work_tile_ptr + work)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # the sequence's query rows are its last q_len positions

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] row of the sequence's queries
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context + q_idx  # [BLOCK_M] row i sees keys 0..q_pos[i]
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    token = q_start + q_idx
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)
    elif not KV_FP8:  # an FP8 cache's values are decoded into the query's own dtype
        q = q.to(k_cache_ptr.dtype.element_ty)
    # The scales of an FP8 cache: K's folded into the scores, V's into the output (one KV head a program).
    qk_scale = scale_log2
    v_scale = 1.0
    if KV_FP8:
        qk_scale = scale_log2 * tl.load(kv_scales_ptr + kv_head)
        v_scale = tl.load(kv_scales_ptr + tl.num_programs(1) + kv_head)

    # Keys this tile needs: up to its last row's position. A split takes one BLOCK_N-aligned share.
    kv_end = tl.minimum(seq_len, context + (tile + 1) * BLOCK_Q)
    if SPLIT:
        split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        kv_start = split * split_len
        kv_stop = tl.minimum(kv_end, kv_start + split_len)
    else:
        kv_start = 0
        kv_stop = kv_end

    # Online softmax in fp32. A finite initial max keeps fully masked rows NaN-free (their p and l stay 0).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_off = kv_head * stride_ch
    for start in range(kv_start, kv_stop, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_ok = offs_n < kv_stop
        block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0)  # [BLOCK_N] int64 physical block
        slot = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_off  # [BLOCK_N] int64
        k = tl.load(
            k_cache_ptr + slot[None, :] + offs_d[:, None] * stride_cd,
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        if KV_FP8:
            k = decode_fp8(k, KV_FP8 == 1)
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee") if DOT_FP32 else tl.dot(q, k.to(q.dtype))
        s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + slot[:, None] + offs_d[None, :] * stride_cd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        if KV_FP8:
            v = decode_fp8(v, KV_FP8 == 1)
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee") if DOT_FP32 else tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv  # [BLOCK_M, BLOCK_D] fp32
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    acc = acc * v_scale
    if SPLIT:
        # Partials of row (token, head) at split s; the reduce kernel rescales them by exp2(m_s - max_s m).
        row = token * (tl.num_programs(1) * GROUP) + head  # [BLOCK_M] = token * num_heads + head
        tl.store(max_ptr + row * num_splits + split, m_i, mask=row_ok)
        tl.store(sum_ptr + row * num_splits + split, l_i, mask=row_ok)
        tl.store(
            out_ptr + (row * num_splits + split)[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask
        )
    else:
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only on padding rows
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            acc.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    acc_ptr,  # [num_tokens * num_heads, num_splits, head_dim] fp32
    max_ptr,  # [num_tokens * num_heads, num_splits] fp32
    sum_ptr,  # [num_tokens * num_heads, num_splits] fp32
    stride_ot,
    stride_oh,
    stride_od,
    num_rows,  # num_tokens * num_heads
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    SPLITS_POW2: tl.constexpr,  # next power of two >= num_splits
    BLOCK_R: tl.constexpr,  # rows (token, head) merged per program
    BLOCK_D: tl.constexpr,
):
    # Grid: (cdiv(num_rows, BLOCK_R),). Row r = token * num_heads + head merges its num_splits partials.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, SPLITS_POW2)
    offs_d = tl.arange(0, BLOCK_D)
    r_ok = rows < num_rows
    rs_ok = r_ok[:, None] & (offs_s[None, :] < num_splits)  # [BLOCK_R, SPLITS_POW2]
    rs = rows[:, None] * num_splits + offs_s[None, :]
    row_max = tl.load(max_ptr + rs, mask=rs_ok, other=-1.0e30)  # [BLOCK_R, SPLITS_POW2]
    row_sum = tl.load(sum_ptr + rs, mask=rs_ok, other=0.0)
    acc = tl.load(
        acc_ptr + rs[:, :, None] * HEAD_DIM + offs_d[None, None, :],
        mask=rs_ok[:, :, None] & (offs_d < HEAD_DIM)[None, None, :],
        other=0.0,
    )  # [BLOCK_R, SPLITS_POW2, BLOCK_D]
    # Empty splits carry m = -1e30 and l = 0, so their weight is exactly 0.
    w = tl.math.exp2(row_max - tl.max(row_max, 1)[:, None])
    total = tl.sum(w * row_sum, 1)
    out = tl.sum(w[:, :, None] * acc, 1) / tl.where(total > 0, total, 1.0)[:, None]  # [BLOCK_R, BLOCK_D]
    token, head = rows // num_heads, rows % num_heads
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=r_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


# The KV_FP8 constexpr of each FP8 cache dtype (its kernels read uint8 views of the codes).
_FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}

# Under TRITON_INTERPRET=1 (read when a kernel is decorated) the kernels run on CPU tensors in the interpreter.
INTERPRETED: bool = not isinstance(_paged_attention_kernel, JITFunction)
# Triton's own library (tl.zeros, tl.max, ...) is decorated at the first `import triton`; the kernels run only
# if it was decorated the same way, i.e. TRITON_INTERPRET did not change between that import and this one.
CONSISTENT: bool = isinstance(tl.zeros, JITFunction) != INTERPRETED


@dataclass(frozen=True)
class TileConfig:
    block_n: int  # keys per inner-loop step (a step may span several cache blocks)
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int | None:
    if device.type != "cuda" or INTERPRETED:
        return None  # the interpreter runs programs one by one: splitting only costs time there
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_programs: int, max_kv_len: int, num_sms: int | None) -> int:
    """Split the keys only when the plain grid leaves SMs short of work and contexts are long enough."""
    target = _SPLIT_PROGRAMS_PER_SM * num_sms if num_sms else 0
    if num_programs >= target:
        return 1
    return max(1, min(-(-target // num_programs), max_kv_len // _MIN_SPLIT_KV, _MAX_SPLITS))


def tile_config(block_m: int, block_d: int, exact_fp32: bool, kv_fp8: bool = False) -> TileConfig:
    """Per-tile launch shape. Chosen from sm_90 register/shared-memory reports (no spills, several CTAs
    per SM), not from timings: the bench is where to tune these. FP8 codes decoded into fp32 tiles for
    exact dots spill when pipelined (sm_80 and sm_90, head_dim 128): a smaller key step, one stage."""
    if INTERPRETED:
        return TileConfig(64, 4, 1)  # the interpreter pays per op: fewest, largest steps
    if exact_fp32 and kv_fp8:
        return TileConfig(32, 8, 1)
    if exact_fp32:
        return TileConfig(64, 8, 3) if block_d <= 128 else TileConfig(32, 8, 2)
    if block_m <= _DECODE_BLOCK_M:
        return TileConfig(64 if block_d <= 128 else 32, 8 if block_d >= 128 else 4, 3)
    if block_d <= 64:
        return TileConfig(64, 4, 3)
    return TileConfig(32, 4, 3) if block_d <= 128 else TileConfig(32, 8, 2)


def _decode_block_m(group: int) -> int:
    """Query-tile rows of a pure-decode launch: one token's GROUP heads, padded to the smallest dot M."""
    return max(_DECODE_BLOCK_M, triton.next_power_of_2(group))


@functools.lru_cache(maxsize=4)
def make_launch_plan(
    query_start_loc: tuple[int, ...],
    seq_lens: tuple[int, ...],
    device: torch.device,
    group: int,
    num_kv_heads: int,
    num_splits: int | None,
    chunk_block_m: int = _CHUNK_BLOCK_M,
) -> LaunchPlan:
    """Tiles the batch and copies its metadata to the device in one transfer. Cached on the (hashable)
    host lists, so the layers of one step after the first reuse it without touching the device."""
    q_lens = [b - a for a, b in itertools.pairwise(query_start_loc)]
    small_m = _decode_block_m(group)
    # One tile size per launch: the small one when every sequence's rows fit in it (pure decode batches).
    block_m = small_m if max(q_lens, default=1) * group <= small_m else max(chunk_block_m, small_m)
    block_q = block_m // group
    work: list[tuple[int, int, int]] = []  # (keys the tile reads, sequence, tile)
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        context = seq_len - q_len
        for tile in range(-(-q_len // block_q)):
            work.append((min(seq_len, context + (tile + 1) * block_q), i, tile))
    work.sort(key=lambda w: -w[0])
    if num_splits is None:
        num_splits = choose_num_splits(len(work) * num_kv_heads, work[0][0] if work else 0, _num_sms(device))
    host = [*query_start_loc, *seq_lens, *(w[1] for w in work), *(w[2] for w in work)]
    meta = torch.tensor(host, dtype=torch.int32).to(device, non_blocking=True)
    num_seqs, num_work = len(seq_lens), len(work)
    qsl, lens, rest = meta.split([num_seqs + 1, num_seqs, 2 * num_work])
    return LaunchPlan(qsl, lens, rest[:num_work], rest[num_work:], num_work, block_m, block_q, num_splits)


def decode_graph_plan(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int, max_seq_len: int
) -> LaunchPlan:
    """The launch plan of a pure-decode batch whose metadata lives in the caller's device buffers, rewritten
    before each replay of a captured graph: query_start_loc [num_seqs + 1] int32 (0, 1, ..., num_seqs) and
    seq_lens [num_seqs] int32. Every sequence is one query row and one tile, in batch order; the key split is
    fixed by the batch size and the longest context the engine allows (a shorter one leaves splits empty,
    whose weight in the reduce is exactly 0), so nothing in the launch depends on the step's lengths."""
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    block_m = _decode_block_m(group)
    device = seq_lens.device
    work_seq = torch.arange(num_seqs, dtype=torch.int32, device=device)
    work_tile = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    num_splits = choose_num_splits(num_seqs * num_kv_heads, max_seq_len, _num_sms(device))
    return LaunchPlan(query_start_loc, seq_lens, work_seq, work_tile, num_seqs, block_m, block_m // group, num_splits)


def _exact_fp32(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """fp32 operands in "ieee" dots: fp32 batches (parity with the reference), and always in the interpreter."""
    return INTERPRETED or query.dtype == torch.float32 or kv_cache.dtype == torch.float32


def launch_plan(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    *,
    num_splits: int | None = None,
) -> LaunchPlan:
    """The (cached) plan `paged_attention_with` launches for these arguments."""
    num_kv_heads = kv_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    exact_on_gpu = _exact_fp32(query, kv_cache) and not INTERPRETED
    chunk_block_m = _DECODE_BLOCK_M if exact_on_gpu else _CHUNK_BLOCK_M
    return make_launch_plan(
        tuple(query_start_loc), tuple(seq_lens), query.device, group, num_kv_heads, num_splits, chunk_block_m
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    kv_scales: torch.Tensor | None = None,
    plan: LaunchPlan | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch over the paged cache (which already holds the new K/V).

    query: [num_tokens, num_heads, head_dim] (any strides), sequence i owning rows
    query_start_loc[i] : query_start_loc[i + 1], the last of its seq_lens[i] context tokens.
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks] int64.
    kv_scales: [2, num_kv_heads] fp32, read by an FP8 cache only (None: ones).
    Returns [num_tokens, num_heads, head_dim] in query's dtype. `plan` (in the place of reference's `decodes`):
    a launch plan over device buffers (`decode_graph_plan`), read instead of the host lists; None: planned
    from the host lists (cached per step), decodes and prefill chunks in one grid.
    """
    args = (query, kv_cache, block_tables, query_start_loc, seq_lens, scale)
    return paged_attention_with(*args, kv_scales=kv_scales, plan=plan)


def paged_attention_with(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    *,
    kv_scales: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    plan: LaunchPlan | None = None,
) -> torch.Tensor:
    """`paged_attention` with the tiling exposed for tests and benchmarks: `num_splits` forces the
    split-KV path (>1) or the single pass (1), None lets the SM count decide; `block_n` overrides the
    keys per inner step (a power of two >= 16); `plan`, when given, is launched as it is (its own splits)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    if plan is None:
        plan = launch_plan(query, kv_cache, query_start_loc, seq_lens, num_splits=num_splits)
    kv_fp8 = _FP8_CODES.get(kv_cache.dtype, 0)
    if kv_fp8:
        if kv_scales is None:
            kv_scales = fp8.unit_scales(num_kv_heads, kv_cache.device)
        kv_scales = kv_scales.to(device=kv_cache.device, dtype=torch.float32).contiguous()
        kv_cache = kv_cache.view(torch.uint8)
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_d = max(16, triton.next_power_of_2(head_dim))
    exact = _exact_fp32(query, kv_cache)
    config = tile_config(plan.block_m, block_d, exact, kv_fp8 > 0)
    split = plan.num_splits > 1
    if split:
        partial = torch.empty(
            num_tokens, num_heads, plan.num_splits, head_dim, dtype=torch.float32, device=out.device
        )
        row_max = torch.empty(num_tokens, num_heads, plan.num_splits, dtype=torch.float32, device=out.device)
        row_sum = torch.empty_like(row_max)
    else:
        partial, row_max, row_sum = out, out, out  # the max/sum pointers are unused without splits
    _paged_attention_kernel[(plan.num_work, num_kv_heads, plan.num_splits)](
        partial,
        row_max,
        row_sum,
        query,
        k_cache,
        v_cache,
        kv_scales if kv_fp8 else block_tables,  # an unused pointer without FP8
        block_tables,
        plan.query_start_loc,
        plan.seq_lens,
        plan.work_seq,
        plan.work_tile,
        scale * _LOG2E,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        plan.num_splits,
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_M=plan.block_m,
        BLOCK_Q=plan.block_q,
        BLOCK_N=block_n or config.block_n,
        BLOCK_D=block_d,
        BLOCK_SIZE=kv_cache.shape[2],
        SPLIT=split,
        DOT_FP32=exact,
        KV_FP8=kv_fp8,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split:
        splits_pow2 = triton.next_power_of_2(plan.num_splits)
        # Keep a program's [BLOCK_R, splits, BLOCK_D] fp32 tile near 8k elements on a GPU; the interpreter
        # pays per program and per op, not per element, so it takes large tiles.
        block_r = 64 if INTERPRETED else max(1, 8192 // (splits_pow2 * block_d))
        num_rows = num_tokens * num_heads
        _reduce_splits_kernel[(triton.cdiv(num_rows, block_r),)](
            out,
            partial,
            row_max,
            row_sum,
            *out.stride(),
            num_rows,
            num_heads,
            plan.num_splits,
            HEAD_DIM=head_dim,
            SPLITS_POW2=splits_pow2,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
        )
    return out
