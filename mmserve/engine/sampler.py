"""Turns one step's logits into token ids (greedy, temperature, top-k, top-p, seeds) and logprobs,
after the grammar mask and the logits processors (logit_bias, min_tokens, bad words, penalties).

Knows `SamplingParams`, token ids and tensors only: nothing of requests, the scheduler or text.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmserve.request import SamplingParams

_MASK64 = (1 << 64) - 1
# Any k >= vocab_size disables top-k; `forward` clamps, so this stands in for "vocab_size".
_TOP_K_OFF = 1 << 31
# Below this, logits / temperature can overflow float32 to inf (nan probs): sample greedily, its limit.
_MIN_TEMPERATURE = 1e-5


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, output_index: int) -> int:
    """The generator seed for a seeded request's `output_index`-th token: a function of both only."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ output_index)


def _to_device(values: list[float] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _host_to_device(torch.tensor(values, dtype=dtype), device)


def _host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        # Pinned + non_blocking: the copy is queued on the stream instead of stalling the host.
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass(frozen=True)
class GrammarBitmask:
    """Token masks of the constrained requests of one step: bit t of row i set = token t allowed."""

    request_ids: tuple[str, ...]
    bitmask: torch.Tensor  # [len(request_ids), ceil(vocab_size / 32)] int32, on the CPU (llguidance's layout)

    def for_rows(self, row_request_ids: Sequence[str]) -> tuple[list[int], torch.Tensor] | None:
        """(sampled rows, their bitmask rows [len(rows), words]) for the requests of this mask that are
        among `row_request_ids` (row i samples for row_request_ids[i]); None when none is."""
        row_of = {request_id: row for row, request_id in enumerate(row_request_ids)}
        picked = [(row_of[r], i) for i, r in enumerate(self.request_ids) if r in row_of]
        if not picked:
            return None
        rows, mask_rows = zip(*picked, strict=True)
        return list(rows), self.bitmask[list(mask_rows)]


@dataclass(frozen=True)
class TokenEntries:
    """(row, token id) pairs of one logits processor, flattened over the rows that use it: entry j
    acts on logits[rows[j], token_ids[j]] with operand values[j]. Duplicates are allowed."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor | None  # [N] or [N, k] float32 operands; None for a ban


def _entries(
    rows: list[int],
    token_ids: list[Sequence[int]],
    values: list[float] | list[tuple[float, ...]] | None,
    device: torch.device,
) -> TokenEntries | None:
    """`token_ids[i]` (with `values[i]`, one per row) acts on row `rows[i]`. None when nothing does."""
    if not any(token_ids):  # the common step: no row uses the field, and no tensor is made
        return None
    lengths = torch.tensor([len(t) for t in token_ids], dtype=torch.int64)  # [len(rows)]
    flat = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.int64)  # [N]
    row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)  # [N]
    operands = None
    if values is not None:
        operands = torch.repeat_interleave(torch.tensor(values, dtype=torch.float32), lengths, dim=0)
    return TokenEntries(
        rows=_host_to_device(row_ids, device),
        token_ids=_host_to_device(flat, device),
        values=_host_to_device(operands, device) if operands is not None else None,
    )


def _banned_by_bad_words(sequences: tuple[tuple[int, ...], ...], output: Sequence[int]) -> list[int]:
    """transformers' NoBadWordsLogitsProcessor for one row: the last token of every sequence whose
    other tokens end `output` (the generated tokens so far); one-token sequences always."""
    banned = []
    for seq in sequences:
        prefix = len(seq) - 1
        if prefix == 0 or (prefix <= len(output) and tuple(output[len(output) - prefix :]) == seq[:-1]):
            banned.append(seq[-1])
    return banned


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-step sampling inputs, one row per sampled request, built once by the model runner."""

    temperature: torch.Tensor  # [num_rows] float32; 0.0 means greedy
    top_k: torch.Tensor | None  # [num_rows] int64, >= vocab_size where off; None when no row uses top-k
    top_p: torch.Tensor | None  # [num_rows] float32, 1.0 where off; None when no row uses top-p
    generators: dict[int, torch.Generator]  # row -> generator, for seeded random rows only
    all_greedy: bool
    max_num_logprobs: int | None  # None when no row asked for logprobs
    # The logits processors' inputs, each None when no row of the step uses it (then it costs nothing).
    grammar_rows: torch.Tensor | None = None  # [G] int64: the rows a grammar constrains
    grammar_bitmask: torch.Tensor | None = None  # [G, words] int32 on the device, llguidance's layout
    logit_bias: TokenEntries | None = None  # values [N]: added
    min_tokens_ban: TokenEntries | None = None  # EOS / stop tokens of rows short of min_tokens
    bad_words_ban: TokenEntries | None = None  # the last tokens of the bad words that match now
    repetition: TokenEntries | None = None  # every prompt and output token; values [N]: the penalty
    presence_frequency: TokenEntries | None = None  # every output token; values [N, 2]: (presence, frequency)

    @functools.cached_property
    def processes_logits(self) -> bool:
        """Whether any row's logits change before temperature (a grammar or a logits processor). Cached: the
        fields are frozen, and one metadata may serve many steps (SamplingMetadataCache)."""
        return any(
            x is not None
            for x in (
                self.grammar_rows,
                self.logit_bias,
                self.min_tokens_ban,
                self.bad_words_ban,
                self.repetition,
                self.presence_frequency,
            )
        )

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        device: torch.device,
        *,
        token_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Sequence[int] = (),
        vocab_size: int | None = None,
        grammar: tuple[Sequence[int], torch.Tensor] | None = None,
    ) -> SamplingMetadata:
        """`output_indices[i]`: how many tokens row i's request has generated so far (seeds the row).

        `token_ids[i]`: row i's prompt followed by its outputs so far (its last `output_indices[i]`
        entries); needed only when some row uses a penalty or a multi-token bad word, and only read
        then. `eos_token_ids`: the model's, banned under min_tokens (unless ignore_eos).
        `vocab_size`: token ids at or beyond it are dropped from bias and bans (they cannot be indexed).
        `grammar`: (rows, [len(rows), words] int32 CPU bitmask) from `GrammarBitmask.for_rows`.
        """
        if len(params) != len(output_indices):
            raise ValueError(f"{len(params)} params but {len(output_indices)} output indices")
        if token_ids is not None and len(token_ids) != len(params):
            raise ValueError(f"{len(params)} params but {len(token_ids)} token id lists")
        device = torch.device(device)
        top_k = None
        if any(p.top_k is not None for p in params):
            top_k = _to_device(
                [_TOP_K_OFF if p.top_k is None else p.top_k for p in params], torch.int64, device
            )
        top_p = None
        if any(p.top_p < 1.0 for p in params):
            top_p = _to_device([p.top_p for p in params], torch.float32, device)
        greedy = [p.temperature < _MIN_TEMPERATURE for p in params]
        generators: dict[int, torch.Generator] = {}
        for row, (p, index) in enumerate(zip(params, output_indices, strict=True)):
            if p.seed is not None and not greedy[row]:
                generators[row] = torch.Generator(device=device).manual_seed(row_seed(p.seed, index))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=_to_device(
                [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                torch.float32,
                device,
            ),
            top_k=top_k,
            top_p=top_p,
            generators=generators,
            all_greedy=all(greedy),
            max_num_logprobs=max(wanted) if wanted else None,
            **_processor_inputs(
                params, output_indices, device, token_ids, eos_token_ids, vocab_size, grammar
            ),
        )


class SamplingMetadataCache:
    """Builds each step's SamplingMetadata (`build` takes `SamplingMetadata.from_params`'s arguments) and
    hands the last one back while it is still right: the step samples the same `SamplingParams` objects in
    the same order, no grammar constrains it, and none of its rows depends on the step. A row depends on
    the step when its inputs change as it generates: a seeded random row (its generator is seeded per
    token), a min_tokens ban still in force, bad words or a penalty (they read the tokens so far). The
    rest of a row's inputs are its params', so equal params objects give an equal metadata; a params
    object shared by several requests (one `generate` call) is fine for the same reason.

    The metadata is only read by the sampler (seeded generators, the one thing a draw advances, are never
    reused), so the same object serves any number of steps."""

    def __init__(self) -> None:
        self._params: list[SamplingParams] = []  # the cached metadata's rows; empty: nothing cached
        self._metadata: SamplingMetadata | None = None

    def build(
        self, params: Sequence[SamplingParams], output_indices: Sequence[int], device: torch.device, **options: Any
    ) -> SamplingMetadata:
        """`SamplingMetadata.from_params(params, output_indices, device, **options)`, or the last one if still right.
        The caller passes the same device, `eos_token_ids` and `vocab_size` every time (one runner's)."""
        cached, grammar = self._metadata, options.get("grammar")
        if (
            cached is not None
            and grammar is None
            and len(params) == len(self._params)
            and all(p is q and n >= p.min_tokens for p, q, n in zip(params, self._params, output_indices, strict=True))
        ):
            return cached
        metadata = SamplingMetadata.from_params(params, output_indices, device, **options)
        reusable = grammar is None and not any(
            _depends_on_step(p, n) for p, n in zip(params, output_indices, strict=True)
        )
        self._params, self._metadata = (list(params), metadata) if reusable else ([], None)
        return metadata


def _depends_on_step(params: SamplingParams, output_index: int) -> bool:
    """Whether a row's sampling inputs change from one step to the next (see SamplingMetadataCache)."""
    return (
        (params.seed is not None and params.temperature >= _MIN_TEMPERATURE)
        or output_index < params.min_tokens
        or bool(params.bad_words_token_ids)
        or params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def _processor_inputs(
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
    device: torch.device,
    token_ids: Sequence[Sequence[int]] | None,
    eos_token_ids: Sequence[int],
    vocab_size: int | None,
    grammar: tuple[Sequence[int], torch.Tensor] | None,
) -> dict[str, torch.Tensor | TokenEntries | None]:
    """SamplingMetadata's logits-processor fields. Host work is per row that uses a field (matching
    bad words, flattening token ids); rows that use none cost one attribute check each."""

    def in_vocab(ids: Sequence[int]) -> list[int]:
        return [t for t in ids if vocab_size is None or t < vocab_size]  # others cannot be indexed

    def history(row: int) -> Sequence[int]:
        if token_ids is None:
            raise ValueError("a row uses a penalty or a multi-token bad word, but no token_ids were given")
        return token_ids[row]

    def outputs(row: int) -> Sequence[int]:
        n = output_indices[row]
        if n == 0:
            return ()
        ids = history(row)
        return ids[len(ids) - n :]

    fields: dict[str, torch.Tensor | TokenEntries | None] = {}
    if grammar is not None and len(grammar[0]):
        rows, bitmask = grammar
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != len(rows):
            raise ValueError(
                f"grammar bitmask: want [{len(rows)}, words] int32, got {bitmask.dtype} {tuple(bitmask.shape)}"
            )
        fields["grammar_rows"] = _to_device(list(rows), torch.int64, device)
        fields["grammar_bitmask"] = _host_to_device(bitmask.contiguous(), device)

    bias = [
        (i, t, b)
        for i, p in enumerate(params)
        for t, b in p.logit_bias
        if vocab_size is None or t < vocab_size
    ]
    if bias:
        rows, ids, values = zip(*bias, strict=True)
        fields["logit_bias"] = TokenEntries(
            _to_device(list(rows), torch.int64, device),
            _to_device(list(ids), torch.int64, device),
            _to_device(list(values), torch.float32, device),
        )

    short_rows = [i for i, p in enumerate(params) if output_indices[i] < p.min_tokens]
    fields["min_tokens_ban"] = _entries(
        short_rows,
        [
            in_vocab(list(params[i].stop_token_ids) + ([] if params[i].ignore_eos else list(eos_token_ids)))
            for i in short_rows
        ],
        None,
        device,
    )

    bad_rows = [i for i, p in enumerate(params) if p.bad_words_token_ids]
    fields["bad_words_ban"] = _entries(
        bad_rows,
        [
            in_vocab(
                _banned_by_bad_words(
                    params[i].bad_words_token_ids,
                    # One-token words need no history: a request of only those never reads token_ids.
                    outputs(i) if any(len(s) > 1 for s in params[i].bad_words_token_ids) else (),
                )
            )
            for i in bad_rows
        ],
        None,
        device,
    )

    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    fields["repetition"] = _entries(
        rep_rows, [history(i) for i in rep_rows], [params[i].repetition_penalty for i in rep_rows], device
    )

    pf_rows = [
        i
        for i, p in enumerate(params)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and output_indices[i] > 0
    ]
    fields["presence_frequency"] = _entries(
        pf_rows,
        [outputs(i) for i in pf_rows],
        [(params[i].presence_penalty, params[i].frequency_penalty) for i in pf_rows],
        device,
    )
    return fields


@dataclass(frozen=True)
class SamplerOutput:
    """Sampled tokens and, when asked for, their raw logprobs.

    Logprob columns are `max_num_logprobs + 1` wide for every row; each request reads only
    its own first `logprobs + 1` columns.
    """

    token_ids: torch.Tensor  # [num_rows] int64
    logprob_token_ids: torch.Tensor | None  # [num_rows, k + 1] int64: chosen token, then the top-k ids
    logprobs: torch.Tensor | None  # [num_rows, k + 1] float32, matching logprob_token_ids


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Sets to -inf every logit outside each row's top-k, then outside its top-p nucleus.

    Exactly k tokens survive top-k even under ties (rank by a stable sort); the nucleus is the
    smallest prefix of the sorted tokens whose probability reaches top_p, so the top token stays.
    """
    num_rows, vocab = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [num_rows, vocab] each
    rank = torch.arange(vocab, device=logits.device).expand(num_rows, vocab)
    remove = torch.zeros_like(logits, dtype=torch.bool)  # [num_rows, vocab], sorted order
    if top_k is not None:
        remove = rank >= top_k.clamp(1, vocab).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of all higher-ranked tokens
        outside = mass_before >= top_p.unsqueeze(1)
        # top_p == 1.0 keeps everything even when rounding pushes the running sum to 1.0 early.
        outside &= (top_p < 1.0).unsqueeze(1)
        remove = remove | outside
    remove = torch.empty_like(remove).scatter_(1, order, remove)  # back to vocab order
    return logits.masked_fill(remove, float("-inf"))


def apply_grammar_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf for every token that bit t of its row's mask does not allow. logits [num_rows,
    vocab]; rows [G] int64 (distinct); bitmask [G, words] int32 on logits' device. Tokens at or beyond
    32 * words are disallowed (a vocab padded past the grammar's tokenizer); bits past vocab ignored."""
    num_masked, words = bitmask.shape
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    # Arithmetic shifts of negative words still leave the wanted bit at position 0.
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(num_masked, words * 32).bool()  # [G, 32 * words]
    if words * 32 >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - words * 32), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, entries: TokenEntries) -> None:
    """In place: logits[row, token] += bias for each entry (values [N])."""
    assert entries.values is not None
    logits.index_put_((entries.rows, entries.token_ids), entries.values, accumulate=True)


def ban_tokens(logits: torch.Tensor, entries: TokenEntries) -> None:
    """In place: logits[row, token] = -inf for each entry."""
    logits.index_put_((entries.rows, entries.token_ids), logits.new_tensor(float("-inf")))


def apply_repetition_penalty(logits: torch.Tensor, entries: TokenEntries) -> None:
    """In place, transformers' RepetitionPenaltyLogitsProcessor: each (row, token) logit once, divided
    by the row's penalty (values [N]) when positive, multiplied when not. Gather, then scatter the
    results back: a token repeated in the history writes the same value, so it is penalized once."""
    assert entries.values is not None
    index = (entries.rows, entries.token_ids)
    score = logits[index]  # [N]
    logits.index_put_(index, torch.where(score > 0, score / entries.values, score * entries.values))


def apply_presence_frequency(logits: torch.Tensor, entries: TokenEntries) -> None:
    """In place, OpenAI's penalties over the generated tokens (values [N, 2]: presence, frequency):
    logits[t] -= frequency * count(t) + presence * (count(t) > 0)."""
    assert entries.values is not None
    index = (entries.rows, entries.token_ids)
    # Presence: subtract once per distinct (row, token) -- repeats of a pair write the same value.
    logits.index_put_(index, logits[index] - entries.values[:, 0])
    # Frequency: once per occurrence.
    logits.index_put_(index, -entries.values[:, 1], accumulate=True)


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """A processed copy of logits [num_rows, vocab], in the documented order: grammar mask,
    logit_bias, min_tokens, bad words, repetition penalty, presence/frequency. One batched op each."""
    logits = logits.clone()
    if metadata.grammar_rows is not None and metadata.grammar_bitmask is not None:
        apply_grammar_bitmask(logits, metadata.grammar_rows, metadata.grammar_bitmask)
    if metadata.logit_bias is not None:
        apply_logit_bias(logits, metadata.logit_bias)
    if metadata.min_tokens_ban is not None:
        ban_tokens(logits, metadata.min_tokens_ban)
    if metadata.bad_words_ban is not None:
        ban_tokens(logits, metadata.bad_words_ban)
    if metadata.repetition is not None:
        apply_repetition_penalty(logits, metadata.repetition)
    if metadata.presence_frequency is not None:
        apply_presence_frequency(logits, metadata.presence_frequency)
    return logits


class Sampler(torch.nn.Module):
    """Samples one token per row. Greedy rows take the argmax; random rows race exponential noise.

    The grammar mask and logits processors (`apply_logits_processors`) act first, greedy rows
    included. Logprobs are those of the raw model distribution (before the grammar, the processors,
    temperature, top-k and top-p: vLLM's default "raw_logprobs"), so they say what the model thought.
    No host syncs: Python branches only on the metadata's flags, never on tensor values.
    """

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # logits: [num_rows, vocab] float32; left unchanged (the processors work on a copy)
        raw_logits = logits
        if metadata.processes_logits:
            logits = apply_logits_processors(logits, metadata)
        greedy_ids = logits.argmax(dim=-1)  # [num_rows]; ties -> lowest index
        if metadata.all_greedy:
            token_ids = greedy_ids
        else:
            token_ids = torch.where(metadata.temperature == 0.0, greedy_ids, self._sample(logits, metadata))
        if metadata.max_num_logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprob_token_ids=None, logprobs=None)
        raw = raw_logits.log_softmax(dim=-1)  # [num_rows, vocab]
        top_values, top_ids = raw.topk(metadata.max_num_logprobs, dim=-1)  # [num_rows, k] each
        chosen = token_ids.unsqueeze(1)  # [num_rows, 1]
        return SamplerOutput(
            token_ids=token_ids,
            logprob_token_ids=torch.cat([chosen, top_ids], dim=1),
            logprobs=torch.cat([raw.gather(1, chosen), top_values], dim=1),
        )

    @staticmethod
    def _sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Random draw for every row (greedy rows' draws are discarded by the caller). [num_rows]"""
        temperature = metadata.temperature
        # Greedy rows divide by 1 so that they produce no inf/nan on the way.
        scaled = logits / torch.where(temperature == 0.0, 1.0, temperature).unsqueeze(1)
        if metadata.top_k is not None or metadata.top_p is not None:
            scaled = apply_top_k_top_p(scaled, metadata.top_k, metadata.top_p)
        probs = scaled.softmax(dim=-1)  # [num_rows, vocab]
        # argmax(p / E) with E ~ Exp(1) samples from p. One batched draw serves unseeded rows;
        # a seeded row's noise is redrawn from its own generator alone, so it does not depend on
        # its position or neighbours.
        noise = torch.empty_like(probs)  # [num_rows, vocab]
        if len(metadata.generators) < probs.shape[0]:
            noise.exponential_()
        for row, generator in metadata.generators.items():
            noise[row].exponential_(generator=generator)
        # A 0 draw would turn a masked token's 0 / 0 into nan, which argmax picks.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)
