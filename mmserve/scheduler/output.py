"""The scheduler <-> model runner contract: one plan goes down, one list-based output comes back.

Pure data, torch-free. The scheduler produces `SchedulerOutput`; only `ModelRunnerOutput` flows back.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.request import MultiModalInput, SamplingParams


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes tokens all_token_ids[num_computed_tokens : num_computed_tokens + len(token_ids)]
    and writes their K/V through `block_ids`. It samples one token iff `sample` is true, i.e. the
    chunk reaches the end of the request's known tokens.
    """

    request_id: str
    token_ids: tuple[int, ...]  # [num_scheduled_tokens]
    num_computed_tokens: int  # tokens already in the KV cache before this step
    block_ids: tuple[int, ...]  # the whole block table; covers num_computed_tokens + len(token_ids)
    sample: bool
    sampling_params: SamplingParams
    num_output_tokens: int  # tokens generated so far; seeds per-step sampling noise
    num_prompt_tokens: int
    mrope_positions: object = None  # [3, num_prompt_tokens] tensor for media prompts; None for text
    mrope_delta: int = 0  # output token i (absolute index) sits at position i + mrope_delta
    mm_inputs: tuple[MultiModalInput, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class EncoderWork:
    """Encode one temporal group of one media item this step; the runner caches the result
    under (mm_input.mm_hash, group) until a plan lists that key in `freed_encoder_keys`."""

    mm_input: MultiModalInput
    group: int


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan of one step. `scheduled` is in batch order; the runner keeps that order."""

    scheduled: tuple[ScheduledRequest, ...]
    num_scheduled_tokens: int
    encoder_work: tuple[EncoderWork, ...] = ()
    freed_encoder_keys: tuple[tuple[str, int], ...] = ()  # evicted: drop before running encoder_work
    # Requests that ended since the last plan, so the runner can drop any state it keeps for them.
    finished_request_ids: frozenset[str] = frozenset()
    preempted_request_ids: frozenset[str] = frozenset()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_decode_tokens(self) -> int:
        """Tokens that extend a request's output (one per decoding request)."""
        return sum(1 for s in self.scheduled if s.num_computed_tokens >= s.num_prompt_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_scheduled_tokens - self.num_decode_tokens

    @property
    def num_encoder_tokens(self) -> int:
        return sum(w.mm_input.tokens_per_group for w in self.encoder_work)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled tokens of one step, one row per `ScheduledRequest` with `sample` set, in plan order.

    `logprobs[i]` maps token id -> logprob (the chosen token plus the top-k) when that request
    asked for logprobs, else None.
    """

    request_ids: tuple[str, ...]
    sampled_token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float] | None, ...]


@dataclass(frozen=True)
class EngineCoreOutput:
    """What one step produced for one request: new token ids, their logprobs, and whether it ended."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[dict[int, float], ...] | None
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when the request first got tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
