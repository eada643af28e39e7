"""The scheduler <-> model runner contract: one incremental plan goes down, one output comes back.

Pure data, torch-free. A request's prompt, media and sampling params cross once, in the first plan
that schedules it (`NewRequestData`, again after a preemption); later plans carry only what changed
(`ScheduledRequest`: new token ids, new block ids, tokens granted). The runner keeps the rest
(`plan_state.RequestStates`). The scheduler produces `SchedulerOutput`; only `ModelRunnerOutput`
flows back.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.request import KVTransferParams, MultiModalInput, SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """What the runner keeps about a request for as long as it runs (sent once per admission)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    mm_inputs: tuple[MultiModalInput, ...] = ()
    mrope_positions: object = None  # [3, num_prompt_tokens] tensor for media prompts; None for text
    mrope_delta: int = 0  # output token i (absolute index) sits at position i + mrope_delta


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step, as a diff against what earlier plans sent.

    The runner computes tokens [num_computed_tokens, num_computed_tokens + num_scheduled_tokens) of the
    request, appending `new_token_ids` to the token ids it knows and `new_block_ids` to its block table
    first (both may be empty). It samples one token iff `sample`, i.e. the grant reaches the end of the
    request's known tokens.
    """

    request_id: str
    num_computed_tokens: int  # tokens already in the KV cache before this step
    num_scheduled_tokens: int
    new_token_ids: tuple[int, ...] = ()  # tokens the runner has not been sent (a decode: its last sample)
    new_block_ids: tuple[int, ...] = ()
    sample: bool = False
    is_decode: bool = False  # extends the output by one token (Request.is_decoding when planned)


def encoder_work_tokens(num_tokens: int, blocks: tuple[int, int, int] | None) -> float:
    """Embedding tokens' worth of encoding a group of `num_tokens`: all of them for the whole tower (`blocks` None),
    a slice (first, end, depth) by its share of the tower's blocks."""
    if blocks is None:
        return float(num_tokens)
    first, end, depth = blocks
    return num_tokens * (end - first) / depth


@dataclass(frozen=True)
class EncoderWork:
    """Encode one temporal group of one media item this step; the runner caches the result
    under (mm_input.mm_hash, group) until a plan lists that key in `freed_encoder_keys`."""

    mm_input: MultiModalInput
    group: int
    load: bool = False  # an encoder instance computed it: the runner loads it (and encodes it only if that fails)
    # A slice of the tower: (first, end, depth) runs blocks [first, end) of its `depth`, continuing the group's
    # partial encode (first > 0) and caching the result only when end == depth; None: the whole tower at once.
    blocks: tuple[int, int, int] | None = None

    @property
    def num_tokens_computed(self) -> float:
        """Embedding tokens' worth of encoder work: a slice counts by its share of the tower's blocks."""
        return 0.0 if self.load else encoder_work_tokens(self.mm_input.tokens_per_group, self.blocks)


@dataclass(frozen=True)
class KVLoad:
    """Read a prefill instance's KV blocks into this instance's (a decode instance's remote prefill).

    `remote_block_ids[i]` of the engine `remote_engine_id` (its handshake side channel at `remote_host`:
    `remote_port`) goes into `local_block_ids[i]`; the blocks a local prefix-cache hit holds are left out of
    both. When the read ends, the prefill instance is told `remote_request_id`, so it frees its blocks.
    """

    request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_tp_size: int
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan of one step. `scheduled` is in batch order; the runner keeps that order.

    The runner applies, in this order: drop `finished_request_ids` and `preempted_request_ids`, add
    `new_requests`, then each `ScheduledRequest`'s diffs.
    """

    scheduled: tuple[ScheduledRequest, ...]
    num_scheduled_tokens: int
    new_requests: tuple[NewRequestData, ...] = ()
    encoder_work: tuple[EncoderWork, ...] = ()
    freed_encoder_keys: tuple[tuple[str, int], ...] = ()  # evicted: drop before running encoder_work
    # Requests that ended since the last plan, so the runner can drop any state it keeps for them.
    finished_request_ids: frozenset[str] = frozenset()
    # Preempted since the last plan: the runner drops them; a readmission sends them as new again.
    preempted_request_ids: frozenset[str] = frozenset()
    # Disaggregation: reads to start now, and whether any read or lease is still open (the workers then
    # report which ended, also in a step that computes nothing).
    kv_loads: tuple[KVLoad, ...] = ()
    kv_transfers_pending: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_work(self) -> bool:
        """Anything for the runner to do or to forget."""
        return bool(
            self.scheduled
            or self.encoder_work
            or self.freed_encoder_keys
            or self.finished_request_ids
            or self.preempted_request_ids
            or self.kv_loads
            or self.kv_transfers_pending
        )

    @property
    def num_decode_tokens(self) -> int:
        """Tokens that extend a request's output (one per decoding request)."""
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_scheduled_tokens - self.num_decode_tokens

    @property
    def num_encoder_tokens(self) -> float:
        """Embedding tokens the encoder computes this step (loaded ones are not computed; a slice of the
        tower counts by its share of the blocks)."""
        return sum(w.num_tokens_computed for w in self.encoder_work)


@dataclass(frozen=True)
class FailedRequest:
    """A request the runner left out of a step because its inputs could not be built."""

    request_id: str
    num_computed_tokens: int  # before the step: what its KV really holds
    message: str  # for the log; never shown to clients


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled tokens of one step, one row per `ScheduledRequest` with `sample` set, in plan order,
    less the requests in `failed`.

    `logprobs[i]` maps token id -> logprob (the chosen token plus the top-k) when that request
    asked for logprobs, else None. The durations are wall seconds of this execute's parts.
    """

    request_ids: tuple[str, ...]
    sampled_token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float] | None, ...]
    failed: tuple[FailedRequest, ...] = ()
    encoder_s: float = 0.0
    forward_s: float = 0.0  # decoder forward + logits
    sampling_s: float = 0.0
    comm_bytes: int = 0  # tensor parallelism: bytes this rank put into collectives in the step
    # Disaggregation: reads (KVLoad.request_id) that ended since the last step, and the requests whose
    # blocks a decode instance has read (this instance prefilled them; their blocks may go).
    kv_loads_done: tuple[str, ...] = ()
    kv_loads_failed: tuple[str, ...] = ()
    kv_sends_done: tuple[str, ...] = ()
    kv_blocks_read: int = 0  # blocks the reads in kv_loads_done brought (each block: every layer's K and V)
    kv_read_s: float = 0.0  # their wall seconds, from posting each read to its completion, summed


@dataclass(frozen=True)
class EngineCoreOutput:
    """What one step produced for one request: new token ids, their logprobs, and whether it ended.

    `finish_reason` "error": the engine failed the request (`error` says how, for the log); the front
    end raises `RequestFailedError` on its stream. Other finish reasons: "stop" | "length" | "abort".
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[dict[int, float], ...] | None
    finish_reason: str | None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when the request first got tokens
    error: str | None = None
    service_class: int | None = None  # the class the scheduler serves it in (after any downgrade)
    # A prefill instance's answer to `do_remote_decode` (on the request's last output): where its KV waits.
    kv_transfer_params: KVTransferParams | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
