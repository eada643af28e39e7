"""Turns the core's `EngineCoreOutput`s into user-facing `RequestOutput`s: detokenizes, applies stop
strings (telling the caller which requests to stop), and keeps per-request timing metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.request import SLO, KVTransferParams, Request, ServiceClass
from mmserve.scheduler.output import EngineCoreOutput


@dataclass
class RequestMetrics:
    """Times from `time.monotonic()`."""

    arrival_time: float
    scheduled_time: float | None = None  # first granted tokens: arrival -> here is queue time
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    preprocess_time: float | None = None  # arrival -> handed to the engine core (media decode included)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """Everything a request has produced so far; `new_text` / `new_token_ids` are this update's share."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it, if any
    logprobs: list[dict[int, float]] | None = None
    metrics: RequestMetrics | None = None
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    # The class the scheduler serves it in (after any admission-control downgrade) and its effective
    # targets: its own SLO over the server's defaults for that class (what metrics judge it by).
    service_class: ServiceClass = ServiceClass.INTERACTIVE
    slo: SLO = field(default_factory=SLO)
    index: int = 0  # which of the request's `n` sequences this is (its choice index)
    kv_transfer_params: KVTransferParams | None = None  # a prefill instance's answer to do_remote_decode

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _RequestState:
    def __init__(
        self, request: Request, prompt: str | None, tokenizer: PreTrainedTokenizerBase, class_slo: SLO
    ) -> None:
        params = request.sampling_params
        self.params = params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, stop=params.stop, min_tokens=params.min_tokens
        )
        self.output = RequestOutput(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            logprobs=[] if params.logprobs is not None else None,
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            # Read after Scheduler.add_request, which may have downgraded the request to batch.
            service_class=request.service_class,
            slo=(params.slo or SLO()).over(class_slo),
        )


class OutputProcessor:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, class_slo: Callable[[ServiceClass], SLO] | None = None
    ) -> None:
        """`class_slo`: the server's default targets per class (SchedulerConfig.class_slo); None: none."""
        self.tokenizer = tokenizer
        self.class_slo = class_slo
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self, request: Request, prompt: str | None, processed_time: float | None = None, index: int = 0
    ) -> None:
        """`processed_time` (time.monotonic()): when the request was ready for the core, if measured.
        `index`: which of its prompt's n sequences the request is."""
        defaults = self.class_slo(request.service_class) if self.class_slo is not None else SLO()
        state = _RequestState(request, prompt, self.tokenizer, defaults)
        state.output.index = index
        if processed_time is not None:
            state.output.metrics.preprocess_time = processed_time - request.arrival_time
        self._states[request.request_id] = state

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Close a request the caller aborted; returns its final output."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        out = state.output
        out.finish_reason, out.new_text, out.new_token_ids = "abort", "", []
        out.metrics.finish_time = time.monotonic()
        return out

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated outputs and the ids of requests a stop string ended (to abort in the core)."""
        now = time.monotonic()
        updated, stopped = [], []
        for core_out in core_outputs:
            state = self._states.get(core_out.request_id)
            if state is None:
                continue
            out, metrics = state.output, state.output.metrics
            if core_out.service_class is not None:  # as the scheduler serves it (a downgrade shows here)
                out.service_class = ServiceClass(core_out.service_class)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.num_cached_tokens = core_out.num_cached_tokens
                metrics.scheduled_time = core_out.first_scheduled_time
            metrics.last_token_time = now
            out.token_ids.extend(core_out.new_token_ids)
            if out.logprobs is not None and core_out.new_logprobs is not None:
                out.logprobs.extend(core_out.new_logprobs)
            out.new_token_ids = list(core_out.new_token_ids)
            out.new_text = state.detokenizer.update(core_out.new_token_ids)
            finish_reason = core_out.finish_reason
            if state.detokenizer.stop_reason is not None:
                if finish_reason is None:
                    stopped.append(core_out.request_id)
                finish_reason, out.stop_reason = "stop", state.detokenizer.stop_reason
            elif finish_reason is not None:
                out.new_text += state.detokenizer.flush()
                last = core_out.new_token_ids[-1] if core_out.new_token_ids else None  # none: an encoder instance's
                if finish_reason == "stop" and last in state.params.stop_token_ids:
                    out.stop_reason = last
            out.text = state.detokenizer.output_text
            if finish_reason is not None:
                out.finish_reason = finish_reason
                out.kv_transfer_params = core_out.kv_transfer_params
                metrics.finish_time = now
                del self._states[core_out.request_id]
            updated.append(out)
        return updated, stopped
