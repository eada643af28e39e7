"""The engine core: one `step()` = schedule -> execute -> update, over token ids only (no text).

Also resolves `EngineArgs` against the checkpoint: device, dtype, KV pool size, context limit.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from mmserve.config import CacheConfig, EngineArgs, SchedulerConfig
from mmserve.engine.model_runner import ModelRunner
from mmserve.models.config import DecoderConfig
from mmserve.request import Request, RequestStatus
from mmserve.scheduler.output import EngineCoreOutput
from mmserve.scheduler.scheduler import Scheduler, SchedulerStats
from mmserve.scheduler.step_time import StepFeatures

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_KV_CACHE_MEMORY = 2 << 30  # default KV pool on CPU when neither blocks nor memory are given
_GPU_KV_CACHE_FRACTION = 0.8  # of the memory free after the weights load
_STEP_HISTORY = 100_000  # steps whose composition and time are kept for benchmarks and plots


@dataclass(frozen=True)
class StepRecord:
    """One executed step: its wall time and what it computed."""

    duration_s: float
    encoder_duration_s: float  # of duration_s, spent in the vision encoder
    num_decode_tokens: int
    num_prefill_tokens: int
    num_encoder_tokens: int
    # The rest of the step-time model's features (scheduler/step_time.py), for `mmserve bench profile`.
    num_seqs: int = 0
    num_context_tokens: int = 0  # sum over scheduled requests of (cached + new) tokens attended to


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.step_history: deque[StepRecord] = deque(maxlen=_STEP_HISTORY)
        self.model_config, self.hf_config = DecoderConfig.from_pretrained(args.model)
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _DTYPES[args.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")]
        num_blocks = self._num_kv_blocks()
        max_model_len = min(
            args.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            num_blocks * args.block_size,
        )
        self.scheduler_config: SchedulerConfig = args.scheduler_config(max_model_len)
        self.cache_config = CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching)
        self.runner = ModelRunner(
            args.model,
            self.model_config,
            self.device,
            self.dtype,
            num_blocks,
            args.block_size,
            self.hf_config,
        )
        # time.monotonic: the clock of Request.arrival_time (stamped by the processor) and of the
        # output metrics, so the `slo` policy's deadlines and the measured TTFT are the same numbers.
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, clock=time.monotonic)

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        return self.scheduler.finish_request(request_id, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty and not plan.encoder_work and not plan.freed_encoder_keys:
            return []
        try:
            runner_output = self.runner.execute(plan)
        except BaseException:
            self.scheduler.forget_cached_state()
            self.runner.encoder_cache.clear()
            raise
        outputs = self.scheduler.update(plan, runner_output)
        duration_s = time.perf_counter() - start
        features = StepFeatures.of_plan(plan)  # one pass over the plan for the model and the record
        self.scheduler.record_step_time(features, duration_s)  # the step-time model's online correction
        self.step_history.append(
            StepRecord(
                duration_s,
                self.runner.last_encoder_duration_s,
                plan.num_decode_tokens,
                plan.num_prefill_tokens,
                plan.num_encoder_tokens,
                features.num_seqs,
                features.context_tokens,
            )
        )
        return outputs

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def _num_kv_blocks(self) -> int:
        args = self.args
        if args.num_kv_blocks is not None:
            return args.num_kv_blocks
        block_bytes = ModelRunner.kv_bytes_per_block(self.model_config, args.block_size, self.dtype)
        memory = args.kv_cache_memory
        if memory is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                weight_bytes = _approx_weight_bytes(self.model_config, self.dtype)
                memory = int((free - weight_bytes) * _GPU_KV_CACHE_FRACTION)
            else:
                # No more than every sequence at full length needs, capped by a fixed budget.
                full = -(-self.model_config.max_position_embeddings // args.block_size) * args.max_num_seqs
                return max(1, min(_CPU_KV_CACHE_MEMORY // block_bytes, full))
        num_blocks = memory // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={memory} bytes holds no KV block of {block_bytes} bytes")
        return num_blocks


def _approx_weight_bytes(cfg: DecoderConfig, dtype: torch.dtype) -> int:
    per_layer = (
        cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        + cfg.num_heads * cfg.head_dim * cfg.hidden_size
        + 3 * cfg.hidden_size * cfg.intermediate_size
    )
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return (per_layer * cfg.num_layers + embeddings) * dtype.itemsize
