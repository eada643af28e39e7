"""Turns one step's logits into token ids (greedy, temperature, top-k, top-p, seeds) and logprobs.

Knows `SamplingParams` and tensors only: nothing of requests, the scheduler or text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        # Pinned + non_blocking: the copy is queued on the stream instead of stalling the host.
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-step sampling inputs, one row per sampled request, built once by the model runner."""

    temperature: torch.Tensor  # [num_rows] float32; 0.0 means greedy
    top_k: torch.Tensor | None  # [num_rows] int64, >= vocab_size where off; None when no row uses top-k
    top_p: torch.Tensor | None  # [num_rows] float32, 1.0 where off; None when no row uses top-p
    generators: dict[int, torch.Generator]  # row -> generator, for seeded random rows only
    all_greedy: bool
    max_num_logprobs: int | None  # None when no row asked for logprobs

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
        device: torch.device,
    ) -> SamplingMetadata:
        """`output_indices[i]`: how many tokens row i's request has generated so far (seeds the row)."""
        if len(params) != len(output_indices):
            raise ValueError(f"{len(params)} params but {len(output_indices)} output indices")
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
        )


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


class Sampler(torch.nn.Module):
    """Samples one token per row. Greedy rows take the argmax; random rows race exponential noise.

    Logprobs are those of the raw model distribution (before temperature, top-k and top-p).
    No host syncs: Python branches only on the metadata's flags, never on tensor values.
    """

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # logits: [num_rows, vocab] float32
        greedy_ids = logits.argmax(dim=-1)  # [num_rows]; ties -> lowest index
        if metadata.all_greedy:
            token_ids = greedy_ids
        else:
            token_ids = torch.where(metadata.temperature == 0.0, greedy_ids, self._sample(logits, metadata))
        if metadata.max_num_logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprob_token_ids=None, logprobs=None)
        raw = logits.log_softmax(dim=-1)  # [num_rows, vocab]
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
