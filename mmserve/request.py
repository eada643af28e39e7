"""Request state shared by the scheduler and the engine: `SamplingParams`, `Request`, statuses.

Torch-free on purpose: the scheduler imports it. It knows token ids, never text or tensors.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

from mmserve.errors import InvalidRequestError


class ServiceClass(enum.IntEnum):
    """Who is waiting for a request. Smaller is more urgent; only the `slo` policy acts on it."""

    INTERACTIVE = 0  # a person watching the stream: fast first token, steady tokens after
    BATCH = 1  # throughput work: takes whatever the interactive requests leave

    @classmethod
    def parse(cls, value: object) -> ServiceClass:
        """Accept a ServiceClass or its lower-case name ("interactive" | "batch")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise InvalidRequestError(
            f"service_class: must be 'interactive' or 'batch', got {value!r}", param="service_class"
        )


@dataclass(frozen=True)
class SLO:
    """Latency targets of one request, in milliseconds; None: no target of that kind.

    ttft_ms: arrival -> first token; tbt_ms: between two output tokens; deadline_ms: arrival -> last token.
    """

    ttft_ms: float | None = None
    tbt_ms: float | None = None
    deadline_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tbt_ms", "deadline_ms"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or not (0.0 < value < 1e9)):
                raise InvalidRequestError(
                    f"slo.{name}: must be None or a number of milliseconds in (0, 1e9), got {value!r}",
                    param=f"slo.{name}",
                )

    @classmethod
    def parse(cls, value: object) -> SLO | None:
        """Accept None, an SLO, or a mapping with (a subset of) its three keys."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"ttft_ms", "tbt_ms", "deadline_ms"}
            if unknown:
                raise InvalidRequestError(
                    f"slo: unknown field(s) {sorted(map(str, unknown))}; expected ttft_ms, tbt_ms, deadline_ms",
                    param="slo",
                )
            return cls(**value)
        raise InvalidRequestError(f"slo: must be an object or null, got {type(value).__name__}", param="slo")

    def over(self, defaults: SLO) -> SLO:
        """This SLO's fields where given, else the defaults' (a request's own targets over its class's)."""
        return SLO(
            self.ttft_ms if self.ttft_ms is not None else defaults.ttft_ms,
            self.tbt_ms if self.tbt_ms is not None else defaults.tbt_ms,
            self.deadline_ms if self.deadline_ms is not None else defaults.deadline_ms,
        )


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on what a request may generate (vLLM's `structured_outputs`): exactly one of
    `json` (a JSON schema, as JSON text), `json_object` (any JSON object), `regex`, `choice` (one of
    these strings) or `grammar` (Lark, or GBNF when it uses `::=`). Checked by the grammar library in
    the front end (`engine/structured_output.py`); the engine core constrains decoding with it."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar must be "
                f"given, got {given or 'none'}",
                param="structured_outputs",
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError(
                "structured_outputs.choice: must be a non-empty list of non-empty strings",
                param="structured_outputs.choice",
            )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(
                    f"structured_outputs.{name}: must be a non-empty string", param=f"structured_outputs.{name}"
                )

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec): what compiles to one grammar, so equal constraints share a compiled one."""
        if self.json is not None:
            return "json", self.json
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", "\x00".join(self.choice)
        return "grammar", self.grammar or ""


@dataclass(frozen=True)
class KVTransferParams:
    """vLLM's `kv_transfer_params` of one request (prefill/decode disaggregation over NIXL).

    Asked of a prefill instance: `do_remote_decode` (keep the prompt's KV blocks for a decode instance to
    read; the answer names them). Given to a decode instance: `do_remote_prefill` with the prefill's
    answer: its engine id, the block ids holding the prompt's KV (block 0 first), the host and port of
    its handshake side channel and the request id its blocks are held under.
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: tuple[int, ...] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    tp_size: int = 1  # of the instance that holds the blocks

    def __post_init__(self) -> None:
        def bad(name: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"kv_transfer_params.{name}: {message}", param=f"kv_transfer_params.{name}")

        for name in ("do_remote_decode", "do_remote_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.remote_block_ids is not None:
            if not isinstance(self.remote_block_ids, (list, tuple)):
                raise bad("remote_block_ids", "must be a list of block ids")
            object.__setattr__(self, "remote_block_ids", tuple(self.remote_block_ids))
        if not _is_int(self.tp_size) or self.tp_size < 1:
            raise bad("tp_size", f"must be an integer >= 1, got {self.tp_size!r}")
        if self.do_remote_decode and self.do_remote_prefill:
            raise bad("do_remote_prefill", "a request is either prefilled for a remote decode or decoded after a "
                      "remote prefill, not both")  # fmt: skip
        if not self.do_remote_prefill:
            return
        for name in ("remote_engine_id", "remote_host", "remote_request_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise bad(name, f"must be a non-empty string with do_remote_prefill, got {value!r}")
        if not _is_int(self.remote_port) or not (0 < self.remote_port < 65536):
            raise bad("remote_port", f"must be a port number with do_remote_prefill, got {self.remote_port!r}")
        if not self.remote_block_ids or not all(_is_int(b) and b >= 0 for b in self.remote_block_ids):
            raise bad("remote_block_ids", "must be a non-empty list of non-negative integers with do_remote_prefill")

    @classmethod
    def parse(cls, value: object) -> KVTransferParams | None:
        """Accept None, a KVTransferParams, or vLLM's JSON object; unknown keys are refused by name. A
        decode-side object whose remote fields are all null (what a router sends a prefill) is fine."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(
                f"kv_transfer_params: must be an object or null, got {type(value).__name__}", param="kv_transfer_params"
            )
        unknown = sorted(map(str, set(value) - set(cls.__dataclass_fields__)))
        if unknown:
            raise InvalidRequestError(
                f"kv_transfer_params: unknown field(s) {unknown}", param="kv_transfer_params"
            )
        fields = {k: v for k, v in value.items() if v is not None}
        return cls(**fields)

    def to_json(self) -> dict[str, object]:
        """vLLM's JSON form, every field present."""
        fields = dataclasses.asdict(self)
        if self.remote_block_ids is not None:
            fields["remote_block_ids"] = list(self.remote_block_ids)
        return fields


# The most sequences one request may ask for (`n`): each holds KV blocks of its own past the prompt.
MAX_N = 64


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Validated once at construction."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None or -1: no top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs besides the chosen token
    priority: int = 0  # smaller is served first by the `priority` policy (vLLM's convention)
    # The `slo` policy's inputs; other policies ignore them. Strings and dicts are accepted and stored
    # as ServiceClass / SLO. The request's effective SLO is `slo` over its class's defaults.
    service_class: ServiceClass = ServiceClass.INTERACTIVE
    slo: SLO | None = None
    # Independent sequences sampled from one prompt: the front end adds n requests, and each after the
    # first shares the first's prompt KV blocks once that prefill is done (`Request.prefill_from`).
    n: int = 1
    structured_outputs: StructuredOutputs | None = None  # constrained decoding; None: free text
    # Logits processors, applied in this order (after any grammar mask): logit_bias, min_tokens, bad
    # words, repetition_penalty, presence/frequency. Defaults are no-ops that cost nothing.
    # OpenAI's: logits[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0), where
    # count(t) is how often t occurs in the tokens generated so far (not the prompt).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' RepetitionPenaltyLogitsProcessor: for every token of the prompt or the output, a
    # positive logit is divided by it and a negative one multiplied. 1.0: off.
    repetition_penalty: float = 1.0
    # (token_id, bias) added to that token's logit, sorted by token id, one entry per token; a
    # {token_id: bias} mapping is accepted too. Token ids are checked against the vocab by the Processor.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # EOS (unless ignore_eos) and stop_token_ids are banned, and stop strings do not end the request,
    # until min_tokens tokens have been generated. At most max_tokens.
    min_tokens: int = 0
    # Banned token sequences (transformers' NoBadWordsLogitsProcessor): the last token of a sequence is
    # banned when the tokens before it end the output so far; a one-token sequence is always banned.
    # The Processor adds each of `bad_words` tokenized with and without a leading space (vLLM's rule).
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # Prefill/decode disaggregation (vLLM's `kv_transfer_params`); None: an ordinary request.
    kv_transfer: KVTransferParams | None = None

    def __post_init__(self) -> None:
        # Accept lists / a single string from users; store tuples so the object stays hashable.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", None)
        object.__setattr__(self, "service_class", ServiceClass.parse(self.service_class))
        object.__setattr__(self, "slo", SLO.parse(self.slo))
        bad_words = self.bad_words
        if isinstance(bad_words, str):
            bad_words = (bad_words,)
        if not isinstance(bad_words, (list, tuple)) and bad_words is not None:
            raise InvalidRequestError("bad_words: must be a list of strings", param="bad_words")
        object.__setattr__(self, "bad_words", tuple(bad_words or ()))
        sequences = self.bad_words_token_ids
        if not isinstance(sequences, (list, tuple)) and sequences is not None:
            raise InvalidRequestError(
                "bad_words_token_ids: must be a list of lists of token ids", param="bad_words_token_ids"
            )
        object.__setattr__(  # a non-sequence entry is kept as it is and fails _validate
            self,
            "bad_words_token_ids",
            tuple(tuple(seq) if isinstance(seq, (list, tuple)) else seq for seq in sequences or ()),
        )
        object.__setattr__(self, "logit_bias", self._parse_logit_bias(self.logit_bias))
        object.__setattr__(self, "kv_transfer", KVTransferParams.parse(self.kv_transfer))
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param}: {message}", param=param)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not (0.0 <= self.temperature <= 100.0):
            raise bad("temperature", f"must be a number in [0, 100], got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise bad("top_k", f"must be None, -1 or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", f"must be an integer or None, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not (0 <= self.logprobs <= 20)):
            raise bad("logprobs", f"must be None or an integer in [0, 20], got {self.logprobs!r}")
        if not _is_int(self.priority):
            raise bad("priority", f"must be an integer, got {self.priority!r}")
        if not _is_int(self.n) or not (1 <= self.n <= MAX_N):
            raise bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise bad("structured_outputs", "must be a StructuredOutputs or None")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not (-2.0 <= value <= 2.0):
                raise bad(name, f"must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not (0.0 < self.repetition_penalty <= 2.0):
            raise bad("repetition_penalty", f"must be a number in (0, 2], got {self.repetition_penalty!r}")
        if not _is_int(self.min_tokens) or not (0 <= self.min_tokens <= self.max_tokens):
            raise bad(
                "min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise bad("bad_words", "must be a list of strings with at least one non-space character")
        if not all(
            isinstance(seq, tuple) and seq and all(_is_int(t) and t >= 0 for t in seq)
            for seq in self.bad_words_token_ids
        ):
            raise bad("bad_words_token_ids", "must be a list of non-empty lists of non-negative integers")

    @staticmethod
    def _parse_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
        """{token_id: bias} or (token_id, bias) pairs -> pairs sorted by token id. Token ids may be digit
        strings (JSON object keys). Biases must lie in [-100, 100] (OpenAI's range)."""

        def bad(message: str) -> InvalidRequestError:
            return InvalidRequestError(f"logit_bias: {message}", param="logit_bias")

        if value is None:
            return ()
        if isinstance(value, dict):
            pairs = list(value.items())
        elif isinstance(value, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in value
        ):
            pairs = [tuple(p) for p in value]
        else:
            raise bad("must be an object {token_id: bias} or a list of [token_id, bias] pairs")
        parsed: dict[int, float] = {}
        for token, bias in pairs:
            if isinstance(token, str) and token.isdecimal():
                token = int(token)
            if not _is_int(token) or token < 0:
                raise bad(f"token ids must be non-negative integers, got {token!r}")
            if not _is_number(bias) or not (-100.0 <= bias <= 100.0):
                raise bad(f"the bias of token {token} must be a number in [-100, 100], got {bias!r}")
            if token in parsed:
                raise bad(f"token {token} is given twice")
            parsed[token] = float(bias)
        return tuple(sorted(parsed.items()))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # NaN is not a number here


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Its blocks are allocated and a prefill instance's KV is being read into them (disaggregation).
    WAITING_FOR_REMOTE_KV = 3
    # Every status from here on is final.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # the engine failed it (a fault in its step); the front end raises

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class PlaceholderRange:
    """Where one media item's embedding tokens sit in the prompt: [offset, offset + length)."""

    offset: int
    length: int


@dataclass(frozen=True, eq=False)
class MultiModalInput:
    """One media item of a request. `mm_hash` identifies its content (pixels + processing) for caches.

    Its embeddings fill the placeholder run and split evenly into `num_groups` temporal groups
    (1 for an image), each encoded on its own: group g covers prompt positions
    [offset + g * tokens_per_group, offset + (g + 1) * tokens_per_group).
    """

    mm_hash: str
    placeholder: PlaceholderRange
    modality: str  # "image" | "video"
    num_groups: int = 1
    data: object = None  # preprocessed pixels for the encoder; opaque to the scheduler

    def __post_init__(self) -> None:
        if self.num_groups < 1 or self.placeholder.length % self.num_groups:
            raise ValueError(
                f"{self.placeholder.length} placeholder tokens do not split into {self.num_groups} groups"
            )

    @property
    def tokens_per_group(self) -> int:
        return self.placeholder.length // self.num_groups

    def group_range(self, group: int) -> tuple[int, int]:
        start = self.placeholder.offset + group * self.tokens_per_group
        return start, start + self.tokens_per_group


@dataclass(eq=False)  # identity: requests are compared as objects, never by value
class Request:
    """A request as the scheduler sees it: token ids, progress and status.

    Invariant: 0 <= num_computed_tokens <= num_tokens; the KV cache holds exactly the first
    num_computed_tokens tokens of `all_token_ids` while the request is RUNNING.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()  # the model's end tokens; ignored with ignore_eos
    arrival_time: float = field(default_factory=time.monotonic)
    mm_inputs: list[MultiModalInput] = field(default_factory=list)
    # M-RoPE: prompt positions [3, num_prompt_tokens] (a tensor, opaque here; None for text, whose
    # positions are 0..n-1), and position of token i >= len(prompt) is i + mrope_delta.
    mrope_positions: object = None
    mrope_delta: int = 0
    # n > 1: the request (same prompt, same media) whose prompt KV this one shares instead of
    # computing it; it waits until that request's prefill is done. None: an ordinary request.
    prefill_from: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit length at first scheduling
    first_scheduled_time: float | None = None  # time.monotonic() when first granted tokens
    num_preemptions: int = 0
    last_token_time: float | None = None  # scheduler clock when the latest output token was applied
    first_token_time: float | None = None  # ... and the first (kept across preemption)
    # Set by the `slo` policy's admission control when it downgrades the request to batch.
    class_override: ServiceClass | None = None
    # Chain hashes of the full blocks of all_token_ids, filled by the KV cache manager.
    block_hashes: list[bytes] = field(default_factory=list)
    arrival_seq: int = 0  # tie-breaker that keeps FCFS stable; set by the scheduler

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Its prompt is in the KV cache and one token is left to compute: the one just sampled.
        The one definition of a decode (the scheduler, the `slo` planner and the plan use it)."""
        return self.num_computed_tokens >= self.num_prompt_tokens and self.num_tokens - self.num_computed_tokens == 1

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def service_class(self) -> ServiceClass:
        if self.class_override is not None:
            return self.class_override
        return self.sampling_params.service_class

    def forks(self) -> list[Request]:
        """n > 1: this request and n - 1 more with the same prompt and media, each a sequence of its own
        (ids `<id>`, `<id>-n1`, ...); the others share its prompt KV once its prefill is done. A seeded
        request's sequence i samples with seed + i, so the n differ but each is reproducible."""
        params = self.sampling_params
        requests = [self]
        for i in range(1, params.n):
            seed = params.seed + i if params.seed is not None else None
            requests.append(
                Request(
                    f"{self.request_id}-n{i}",
                    self.prompt_token_ids,
                    dataclasses.replace(params, seed=seed),
                    eos_token_ids=self.eos_token_ids,
                    arrival_time=self.arrival_time,
                    mm_inputs=self.mm_inputs,
                    mrope_positions=self.mrope_positions,
                    mrope_delta=self.mrope_delta,
                    prefill_from=self.request_id,
                )
            )
        return requests

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
