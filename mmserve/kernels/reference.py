"""Pure-torch paged KV cache kernels: the specification every fast kernel must match, and the CPU path.

KV cache layout, per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V).
Token t of a sequence lives in block block_table[t // block_size] at offset t % block_size.
An FP8 cache (`kernels/fp8.py`) holds K / kv_scales[0] and V / kv_scales[1] per KV head; attention reads
them back in the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmserve.kernels import fp8


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write new K/V into their slots. key, value: [num_tokens, num_kv_heads, head_dim];
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; kv_scales: [2, num_kv_heads]
    fp32, used by an FP8 cache only (None: ones)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    if fp8.is_fp8(kv_cache.dtype):  # torch copies FP8 codes as bytes (no index_copy_ for float8 on the CPU)
        scales = _scales(kv_scales, kv_cache)
        flat = flat.view(torch.uint8)
        key = fp8.quantize(key, scales[0], kv_cache.dtype).view(torch.uint8)
        value = fp8.quantize(value, scales[1], kv_cache.dtype).view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))


def _scales(kv_scales: torch.Tensor | None, kv_cache: torch.Tensor) -> torch.Tensor:
    """[2, num_kv_heads] fp32 on the cache's device."""
    if kv_scales is None:
        return fp8.unit_scales(kv_cache.shape[3], kv_cache.device)
    return kv_scales.to(device=kv_cache.device, dtype=torch.float32)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    kv_scales: torch.Tensor | None = None,
    decodes: DecodeRows | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch over the paged cache (which already holds the new K/V).

    query: [num_tokens, num_heads, head_dim], sequence i owning rows
    query_start_loc[i] : query_start_loc[i + 1]; those are the last tokens of its seq_lens[i]
    context tokens, so a decode has one row and a prefill chunk many.
    block_tables: [num_seqs, max_blocks_per_seq]. Returns [num_tokens, num_heads, head_dim].
    kv_scales: [2, num_kv_heads] fp32, read by an FP8 cache only (None: ones). `decodes`: the batch's
    `decode_rows`, when the caller built them once for every layer (None: found here). Decodes are batched in
    padded calls of similar lengths (see _length_buckets); prefill chunks go one by one.
    """
    out = torch.empty_like(query)
    decode_idx = decode_seqs(query_start_loc) if decodes is None else decodes.seqs
    for bucket in _length_buckets([seq_lens[i] for i in decode_idx]):
        seqs = [decode_idx[j] for j in bucket]  # longest first
        rows = torch.tensor([query_start_loc[i] for i in seqs], device=query.device)
        lens = torch.tensor([seq_lens[i] for i in seqs], device=query.device)
        out[rows] = _decode_attention(
            query[rows], kv_cache, block_tables[seqs], lens, seq_lens[seqs[0]], scale, kv_scales
        )
    prefill_attention(out, query, kv_cache, block_tables, query_start_loc, seq_lens, scale, kv_scales)
    return out


def decode_seqs(query_start_loc: list[int]) -> list[int]:
    """The sequences of a varlen batch with exactly one query row."""
    return [i for i in range(len(query_start_loc) - 1) if query_start_loc[i + 1] - query_start_loc[i] == 1]


@dataclass(frozen=True)
class DecodeRows:
    """A varlen batch's sequences with exactly one query row (its decodes), gathered once per step: the model
    runner builds it beside the ForwardBatch so no layer's attention rebuilds it."""

    seqs: list[int]  # [num_decodes] their indices among the batch's sequences
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, contiguous, on the batch's device
    seq_lens: torch.Tensor  # [num_decodes] int64 on the host: context length after this step
    rows: torch.Tensor  # [num_decodes] int64 on the host: each one's query row


def decode_rows(block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int]) -> DecodeRows:
    """The decodes of a batch whose sequence i owns query rows [query_start_loc[i], query_start_loc[i + 1])
    and block_tables[i] ([num_seqs, max_blocks] int64)."""
    seqs = decode_seqs(query_start_loc)
    host = torch.tensor(decode_row_values(seqs, query_start_loc, seq_lens), dtype=torch.int64)
    return decode_rows_of(block_tables, seqs, host[: len(seqs)], host[len(seqs) :])


def decode_row_values(seqs: list[int], query_start_loc: list[int], seq_lens: list[int]) -> list[int]:
    """The values of `DecodeRows`' two host tensors, in order: the decodes' context lengths, then their rows."""
    return [seq_lens[i] for i in seqs] + [query_start_loc[i] for i in seqs]


def decode_rows_of(block_tables: torch.Tensor, seqs: list[int], seq_lens: torch.Tensor, rows: torch.Tensor) -> DecodeRows:
    """`DecodeRows` from the decodes' indices `seqs` and host tensors of `decode_row_values` (a caller that keeps
    its step inputs in persistent buffers writes them there); block_tables: the whole batch's."""
    tables = block_tables if len(seqs) == block_tables.shape[0] else block_tables[seqs]
    if tables.dtype != torch.int64 or not tables.is_contiguous():  # the runner's are already both
        tables = tables.to(torch.int64).contiguous()
    return DecodeRows(seqs=seqs, block_tables=tables, seq_lens=seq_lens, rows=rows)


def prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Writes into `out` the rows of every sequence with more than one query row (a prefill chunk),
    one sequence at a time; arguments as paged_attention's."""
    for i in range(len(seq_lens)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end - start == 1:
            continue
        # [seq_len, num_kv_heads, head_dim] each, in the query's dtype
        key, value = _gather_kv(kv_cache, block_tables[i], seq_lens[i], kv_scales, query.dtype)
        num_q, seq_len = end - start, seq_lens[i]
        if num_q == seq_len:  # nothing cached before the chunk: plain causal, SDPA's fast path
            out[start:end] = _causal_sdpa(query[start:end], key, value, scale)
        elif _pads_to_causal(query.dtype, num_q, seq_len):
            out[start:end] = _padded_causal_sdpa(query[start:end], key, value, scale)
        else:
            out[start:end] = _chunk_attention(query[start:end], key, value, scale)


# fp32 chunks of at least this many rows, after at most as many cached tokens, take _padded_causal_sdpa: there the
# flash kernel's skipped upper half outweighs the pad rows' work. bf16's batched products beat it at every shape.
_PAD_MIN_ROWS = 1024


def _pads_to_causal(dtype: torch.dtype, num_q: int, seq_len: int) -> bool:
    return dtype == torch.float32 and num_q >= _PAD_MIN_ROWS and seq_len - num_q <= num_q


def _padded_causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk after cached context as plain causal attention over the whole sequence: the queries go in after
    seq_len - num_q zero rows, so query j sits at position seq_len - num_q + j and the causal mask lets it see
    exactly the keys up to there; the pad rows' outputs are dropped. Arguments as _chunk_attention's."""
    num_q, seq_len = query.shape[0], key.shape[0]
    padded = query.new_zeros(seq_len, *query.shape[1:])
    padded[seq_len - num_q :] = query
    return _causal_sdpa(padded, key, value, scale)[seq_len - num_q :]


_SCORES_PER_TILE = 1 << 22  # fp32 attention scores held at once by _chunk_attention: 16 MiB


def _chunk_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """A prefill chunk after cached context. query: [num_q, num_heads, head_dim], the last num_q of the
    seq_len positions in key/value: [seq_len, num_kv_heads, head_dim]; query j sits at position
    seq_len - num_q + j and sees keys up to there.

    Each KV head's query heads attend as one block in plain batched products (baddbmm with the causal
    bias, softmax, bmm): on the CPU 1.2-2x faster than SDPA's masked flash kernel for a video's chunks
    (63 rows over 3k tokens: 5.2 ms a layer against 11 ms). Query rows go in tiles that keep the scores
    under _SCORES_PER_TILE, each tile seeing only the keys up to its last row."""
    num_q, num_heads, head_dim = query.shape
    seq_len, num_kv_heads = key.shape[0], key.shape[1]
    group = num_heads // num_kv_heads
    key_t = key.permute(1, 2, 0)  # [num_kv_heads, head_dim, seq_len]
    value = value.transpose(0, 1)  # [num_kv_heads, seq_len, head_dim]
    positions = torch.arange(seq_len, device=query.device)
    out = torch.empty_like(query)
    tile = max(1, _SCORES_PER_TILE // (num_heads * seq_len))
    for first in range(0, num_q, tile):
        rows = min(tile, num_q - first)
        visible = seq_len - num_q + first + rows  # keys the tile's last row sees
        q_pos = positions[seq_len - num_q + first : visible]
        bias = torch.zeros(rows, visible, dtype=query.dtype, device=query.device)
        bias.masked_fill_(positions[None, :visible] > q_pos[:, None], float("-inf"))  # [rows, visible]
        # [num_kv_heads, group * rows, head_dim]: row (g, r) is query head kv_head * group + g at row r
        q = query[first : first + rows].view(rows, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q = q.reshape(num_kv_heads, group * rows, head_dim)
        scores = torch.baddbmm(
            bias.repeat(group, 1).expand(num_kv_heads, -1, -1), q, key_t[..., :visible], alpha=scale
        )  # [num_kv_heads, group * rows, visible]
        tile_out = torch.bmm(torch.softmax(scores, dim=-1), value[:, :visible])
        out[first : first + rows] = (
            tile_out.view(num_kv_heads, group, rows, head_dim)
            .permute(2, 0, 1, 3)
            .reshape(rows, num_heads, head_dim)
        )
    return out


_BUCKET_SLACK_TOKENS = 256


def _length_buckets(lens: list[int]) -> list[list[int]]:
    """Indices into `lens` grouped for padded decode attention, longest first within and across groups.
    A sequence joins the current group if padding it to the group's longest at most doubles its length
    or adds at most _BUCKET_SLACK_TOKENS: one long video's decode would otherwise pad every short chat
    in the batch to the video's length (measured: 63 decodes beside one of 2,070 tokens took 1.3 s a
    step instead of 0.15 s)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lens)), key=lens.__getitem__, reverse=True):
        longest = lens[groups[-1][0]] if groups else 0
        if groups and (2 * lens[i] >= longest or longest - lens[i] <= _BUCKET_SLACK_TOKENS):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _gather_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    kv_scales: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-seq_len // block_size)]
    # index_select along the leading dim of K and V apiece: one contiguous copy of whole blocks each, about
    # 2x faster on the CPU than one index_select along dim 1 of the [2, ...] cache, and than advanced indexing.
    key = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
    value = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len]
    return _readable(key, value, kv_cache, kv_scales, dtype)


def _readable(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered K/V as attention reads them: FP8 codes decoded and scaled into `dtype`, others as stored."""
    if not fp8.is_fp8(kv_cache.dtype):
        return key, value
    scales = _scales(kv_scales, kv_cache)
    return fp8.dequantize(key, scales[0], dtype), fp8.dequantize(value, scales[1], dtype)


def _decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
    kv_scales: torch.Tensor | None,
) -> torch.Tensor:
    """One query row per sequence. query: [num_seqs, num_heads, head_dim].

    The query heads that share a KV head attend as one [group, head_dim] query block (head h reads KV
    head h // group, transformers' repeat_kv order), so K/V are never expanded to num_heads: on the
    CPU this is about 1.5x faster than SDPA's enable_gqa at a batch of 64 decodes."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_blocks = -(-max_len // block_size)
    blocks = block_tables[:, :num_blocks].reshape(-1)
    padded = (num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    # [num_seqs, num_kv_heads, max_len, head_dim] each, gathered as in _gather_kv
    k = kv_cache[0].index_select(0, blocks).view(padded)[:, :max_len]
    v = kv_cache[1].index_select(0, blocks).view(padded)[:, :max_len]
    k, v = (t.transpose(1, 2) for t in _readable(k, v, kv_cache, kv_scales, query.dtype))
    mask = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]  # [num_seqs, max_len]
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _causal_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention, num_q == seq_len. query: [seq_len, num_heads, head_dim]; key/value:
    [seq_len, num_kv_heads, head_dim]. SDPA's causal fast path skips the masked half. The inputs go in as
    [1, heads, seq_len, head_dim]: SDPA takes its flash kernel only for 4-D inputs, and 3-D ones (no batch
    dimension) fall back to the math path, which builds the full [heads, seq_len, seq_len] scores and mask."""
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        key.transpose(0, 1).unsqueeze(0),
        value.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


# The decoder's elementwise steps (`kernels/cpu_fused.py` fuses each into one C call with these signatures).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> RMSNorm(x) * weight, as transformers' Qwen2RMSNorm: other dtypes normalise in fp32
    and round back before the weight; fp32 takes F.rms_norm (one fused op, the same steps up to rounding)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [rows, hidden] -> (RMSNorm(x + residual) * weight, x + residual); residual None:
    (RMSNorm(x) * weight, x). Neither input is written."""
    hidden = x if residual is None else x + residual
    return rms_norm(hidden, weight, eps), hidden


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 * inter] (gate, then up) -> SiLU(gate) * up: [rows, inter]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_qk(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv: [num_tokens, >= (num_heads + num_kv_heads) * head_dim], q's heads then k's (v's may follow);
    cos, sin: [num_tokens, 1, head_dim]. -> q [num_tokens, num_heads, head_dim], k [num_tokens,
    num_kv_heads, head_dim]: each head RMSNorm-ed over head_dim first when the norm weights are given (Qwen3;
    both or neither), then rotated (rotate-half, transformers' convention)."""
    head_dim = cos.shape[-1]
    heads = num_heads + num_kv_heads
    qk = qkv[:, : heads * head_dim].reshape(-1, heads, head_dim)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rotary_qk: give both q and k norm weights, or neither")
    if q_norm_weight is not None and k_norm_weight is not None:
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        qk = torch.cat([rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)], dim=1)
    x1, x2 = qk.chunk(2, dim=-1)  # q and k rotate as one tensor: the same elementwise ops, half the calls
    rotated = qk * cos + torch.cat((-x2, x1), dim=-1) * sin
    q, k = rotated.split([num_heads, num_kv_heads], dim=1)
    return q, k
