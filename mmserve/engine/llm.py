"""`LLM`: the offline API. Generates for a batch of prompts or conversations and returns outputs in
input order, running the engine core's step loop in the calling thread."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mmserve.config import EngineArgs
from mmserve.encoders.media import MediaLimits
from mmserve.engine.faults import EngineFatalError, RequestFailedError
from mmserve.engine.loader import load_engine
from mmserve.engine.messages import EngineInfo, StepRecord
from mmserve.engine.output_processor import OutputProcessor, RequestOutput
from mmserve.engine.processor import Message, PromptType
from mmserve.errors import EngineDeadError, InvalidRequestError
from mmserve.request import Request, RequestStatus, SamplingParams
from mmserve.scheduler.scheduler import SchedulerStats

_STEP_RECORDS = 100_000  # steps kept for benchmarks and plots


class LLM:
    def __init__(
        self,
        model: str | Path,
        *,
        device: str | None = None,
        dtype: str | None = None,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 128,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        scheduler_policy: str = "fcfs",
        max_model_len: int | None = None,
        max_num_encoder_tokens: int | None = None,
        encoder_cache_size: int | None = None,
        chunk_encoder: bool = True,
        media_limits: MediaLimits | None = None,
        **engine_args: Any,
    ) -> None:
        """Any other `EngineArgs` field goes through `engine_args`, e.g. the `slo` policy's
        `interactive_ttft_ms`, `interactive_tbt_ms`, `admission_control` or `step_time_model`."""
        args = EngineArgs(
            model=str(model),
            device=device,
            dtype=dtype,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching,
            scheduler_policy=scheduler_policy,
            max_model_len=max_model_len,
            max_num_encoder_tokens=max_num_encoder_tokens,
            encoder_cache_size=encoder_cache_size,
            chunk_encoder=chunk_encoder,
            **engine_args,
        )
        loaded = load_engine(args, media_limits)
        self.tokenizer, self.engine, self.processor = loaded.tokenizer, loaded.core, loaded.processor
        self._request_counter = itertools.count()
        # Every executed step's record, in order, as the core emits them (benchmarks read and clear it).
        self.step_records: deque[StepRecord] = deque(maxlen=_STEP_RECORDS)
        self._dead: str | None = None

    def close(self) -> None:
        """Stop the engine's workers (tensor-parallel ranks); idempotent. The LLM is unusable after."""
        self._dead = self._dead or "the LLM is closed"
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in order; n outputs for a prompt whose params ask `n > 1`."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        # Validate every prompt before queueing any, so a bad one leaves no request behind.
        processed = [
            self.processor.process(p, sp, str(next(self._request_counter)))
            for p, sp in zip(prompts, params, strict=True)
        ]
        # n > 1: the prompt's n sequences, consecutive in the result (each output's `index` says which).
        requests = [(r, text) for request, text in processed for r in request.forks()]
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the checkpoint's chat template applies."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.processor.chat_prompt(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> SchedulerStats:
        return self.engine.stats()

    def info(self) -> EngineInfo:
        """What the engine runs with: dtype, KV cache dtype, blocks, bytes per KV token, weight bytes."""
        return self.engine.info()

    def _run(self, requests: list[tuple[Request, str | None]], use_tqdm: bool) -> list[RequestOutput]:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            return self._generate(requests, use_tqdm)
        except EngineFatalError as exc:  # a rank died or hung: the engine cannot go on
            self._dead = f"the engine died: {exc}"
            self.engine.close()
            raise EngineDeadError(self._dead) from exc

    def _generate(self, requests: list[tuple[Request, str | None]], use_tqdm: bool) -> list[RequestOutput]:
        outputs = OutputProcessor(self.tokenizer, self.engine.scheduler_config.class_slo)
        order = {request.request_id: i for i, (request, _) in enumerate(requests)}
        added = []
        try:
            for request, text in requests:
                self.engine.add_request(request)
                added.append(request.request_id)
                index = order[request.request_id] - order.get(request.prefill_from or "", order[request.request_id])
                outputs.add_request(request, text, index=index)
            results: list[RequestOutput | None] = [None] * len(requests)
            with tqdm(total=len(requests), disable=not use_tqdm, desc="generate") as bar:
                idle_steps = 0
                while self.engine.has_unfinished_requests():
                    step = self.engine.step()
                    if step.step is not None:
                        self.step_records.append(step.step)
                    # Two steps in a row with nothing running means nothing ever will: fail, don't hang.
                    busy = step.outputs or step.stats.num_running or self.engine.has_pending_grammars() or (
                        step.stats.num_loading_remote_kv  # a read from a prefill instance is under way
                    )
                    idle_steps = 0 if busy else idle_steps + 1
                    if idle_steps > 1:
                        raise EngineDeadError("the scheduler admits nothing while no request runs")
                    failed = next((o for o in step.outputs if o.error is not None), None)
                    if failed is not None:
                        raise RequestFailedError(f"request {failed.request_id}: {failed.error}")
                    updated, stopped = outputs.process(list(step.outputs))
                    self.engine.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
                    for out in updated:
                        if out.finished:
                            results[order[out.request_id]] = out
                            bar.update(1)
        except BaseException:
            self.engine.abort_requests(added)
            raise
        return results  # type: ignore[return-value]


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(
            f"sampling_params: got {len(params)} for {n} prompts", param="sampling_params"
        )
    return params
