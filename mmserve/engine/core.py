"""The engine core: one `step()` = schedule -> execute -> update, over token ids only (no text).

It owns the scheduler and the executor and speaks only values: requests and aborts in, one
`EngineCoreOutputs` per step out (failed requests included), `info()` and utility calls for the rest.
No caller reaches into the scheduler or the runner. Also resolves `EngineArgs` against the
checkpoint: device, dtype, KV pool size, context limit.

Faults: a request whose inputs fail to build fails alone; a step that fails on the device fails the
requests it touched (and those part-way into their media); any other step error fails every request
in flight. The core goes on in all three cases. `EngineFatalError` (a tensor-parallel rank died, hung
or left lockstep) and `EngineLoopKilled` (tests) escape: the engine cannot go on.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Iterable
from typing import Any

import torch

from mmserve.config import CacheConfig, EngineArgs, SchedulerConfig
from mmserve.engine.decode_graphs import default_capture_sizes
from mmserve.engine.device import resolve_device, resolve_dtype
from mmserve.engine.ec_connector import SharedEncoderStore
from mmserve.engine.executor import Executor, InProcessExecutor
from mmserve.engine.faults import EngineFatalError, StepFault
from mmserve.engine.kv_event_publisher import KVEventPublisher
from mmserve.engine.messages import EngineCoreOutputs, EngineInfo, StepRecord
from mmserve.engine.model_runner import ModelRunner
from mmserve.engine.structured_output import StructuredOutputManager
from mmserve.kernels.fp8 import KV_CACHE_DTYPES, kv_cache_dtype_name
from mmserve.models.config import DecoderConfig
from mmserve.models.parallel import check_tensor_parallel
from mmserve.models.quant.linear import CPU, held_bytes_per_weight, resolve_compute_path
from mmserve.request import Request, RequestStatus
from mmserve.scheduler.output import EngineCoreOutput
from mmserve.scheduler.scheduler import Scheduler, SchedulerStats
from mmserve.scheduler.step_time import StepFeatures

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_KV_CACHE_MEMORY = 2 << 30  # default KV pool on CPU when neither blocks nor memory are given
_GPU_KV_CACHE_FRACTION = 0.8  # of the memory free after the weights load
_FAILED = "the request failed inside the engine"
_GRAMMAR_WAIT_S = 0.05  # a step with nothing to run waits this long at most for a grammar to compile
_SNAPSHOT_EVENTS_PER_BATCH = 16  # KV events (up to 1,024 blocks each) per snapshot message: a few MB at most

__all__ = ["EngineCore", "EngineCoreOutputs", "StepRecord"]


class EngineCore:
    # Methods a front end may call by name (`call_utility`), in or out of process.
    UTILITIES = frozenset({"stats", "reset_prefix_cache", "inject_faults", "info", "leak_report"})

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.model_config, self.hf_config = DecoderConfig.from_pretrained(args.model)
        self.device = resolve_device(args.device)
        dtype_name = resolve_dtype(args.dtype, self.device)
        self.dtype = DTYPES[dtype_name]
        self.kv_cache_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype] or self.dtype
        self.tensor_parallel_size = args.tensor_parallel_size
        check_tensor_parallel(self.model_config, self.tensor_parallel_size)  # before any rank starts
        num_blocks = self._num_kv_blocks()
        max_model_len = min(
            args.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            num_blocks * args.block_size,
        )
        self.scheduler_config: SchedulerConfig = args.scheduler_config(max_model_len)
        events = args.kv_events_config if args.kv_events_config is not None and args.kv_events_config.enabled else None
        self.cache_config = CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching, events is not None)
        # Disaggregation: the id decode instances know this one by (vLLM's engine_id; a fresh uuid by default).
        self.kv_transfer_config = args.kv_transfer_config
        if self.kv_transfer_config is not None and self.kv_transfer_config.engine_id is None:
            self.kv_transfer_config = dataclasses.replace(self.kv_transfer_config, engine_id=str(uuid.uuid4()))
        # Bound before the model loads, so a busy port fails the start at once.
        self._kv_events = KVEventPublisher(events) if events is not None else None
        # Encoder disaggregation: the shared directory an encoder instance fills and a prefill instance reads.
        ec = args.ec_transfer_config
        self._encoder_store = SharedEncoderStore(ec.shared_storage_path) if ec is not None else None
        executor: Executor | None = None
        try:
            executor = self._start_executor(dtype_name, num_blocks)
            # time.monotonic: the clock of Request.arrival_time (stamped by the front end) and of the
            # output metrics, so the `slo` policy's deadlines and the measured TTFT are the same numbers.
            kv_transfer = None
            if self.kv_transfer_config is not None:
                kv_transfer = (self.kv_transfer_config, str(self.kv_transfer_config.engine_id))
            store = self._encoder_store
            self._scheduler = Scheduler(self.scheduler_config, self.cache_config, clock=time.monotonic,
                                        kv_transfer=kv_transfer, encoder_outputs=store.contains if store else None,
                                        encode_only=args.ec_transfer_config is not None
                                        and args.ec_transfer_config.is_producer,
                                        encoder_depth=self._encoder_depth())  # fmt: skip
        except BaseException:  # nothing started here outlives a failed start
            if self._kv_events is not None:
                self._kv_events.close()
            if executor is not None:
                executor.close()
            raise
        self.executor: Executor = executor
        self._structured: StructuredOutputManager | None = None  # made for the first constrained request

    def _start_executor(self, dtype_name: str, num_blocks: int) -> Executor:
        """The model on one device (in this process) or split over tensor-parallel rank processes."""
        args = self.args
        if self.tensor_parallel_size == 1:
            runner = ModelRunner(
                args.model, self.model_config, self.device, self.dtype, num_blocks, args.block_size, self.hf_config,
                kv_cache_dtype=self.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
                quant_compute=args.quant_compute, encoder_store=self._encoder_store,
                store_encoder_outputs=args.ec_transfer_config is not None and args.ec_transfer_config.is_producer,
                enforce_eager=args.enforce_eager, max_model_len=self.max_model_len,
                cuda_graph_sizes=args.cuda_graph_sizes or default_capture_sizes(args.max_num_seqs),
            )  # fmt: skip
            kv_worker = None
            if self.kv_transfer_config is not None:
                from mmserve.engine.nixl_connector import NixlKVWorker

                config = self.kv_transfer_config
                kv_worker = NixlKVWorker(runner.kv_caches, args.block_size, str(config.engine_id), config)
            return InProcessExecutor(runner, kv_worker)
        from mmserve.engine.multirank_executor import MultiRankExecutor

        return MultiRankExecutor(
            args.model,
            self.model_config,
            self.hf_config,
            self.device,
            dtype_name,
            self.dtype,
            num_blocks,
            args.block_size,
            self.tensor_parallel_size,
            args.distributed_timeout_s,
            host=args.master_addr,
            port=args.master_port,
            num_local_ranks=args.tensor_parallel_local_ranks,
            mm_encoder_tp_mode=args.mm_encoder_tp_mode,
            kv_cache_dtype=args.kv_cache_dtype,
            calculate_kv_scales=args.calculate_kv_scales,
            quant_compute=args.quant_compute,
        )

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def info(self) -> EngineInfo:
        graph_mode, graph_sizes, _ = self.executor.decode_graphs()
        block_bytes = ModelRunner.kv_bytes_per_block(
            self.model_config, self.args.block_size, self.kv_cache_dtype, self.tensor_parallel_size
        )
        return EngineInfo(
            model=str(self.args.model),
            max_model_len=self.max_model_len,
            scheduler_config=self.scheduler_config,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            attention_backend=self.executor.attention_backend(),
            block_size=self.args.block_size,
            num_kv_blocks=self.cache_config.num_blocks,
            kv_cache_bytes=block_bytes * self.cache_config.num_blocks,
            kv_cache_dtype=kv_cache_dtype_name(self.kv_cache_dtype),
            tensor_parallel_size=self.tensor_parallel_size,
            weight_bytes=self.executor.weight_bytes(),
            disaggregation=self._disaggregation(),
            decode_graph_mode=graph_mode,
            decode_graph_sizes=graph_sizes,
            decode_stack=self.executor.decode_stack_blocker() is None,
        )

    def _disaggregation(self) -> str | None:
        parts = []
        config, ec = self.kv_transfer_config, self.args.ec_transfer_config
        if config is not None:
            parts.append(f"{config.kv_role} as engine {config.engine_id}, NIXL side channel on "
                         f"{config.side_channel_host}:{config.side_channel_port}")  # fmt: skip
        if ec is not None:
            parts.append(f"{ec.ec_role} of encoder outputs in {ec.shared_storage_path}")
        return "; ".join(parts) or None

    def add_request(self, request: Request) -> None:
        """Raises MMServeError (InvalidRequestError, SloInfeasibleError...) if the scheduler refuses it.
        A constrained request waits in the scheduler, held, until its grammar is compiled."""
        self._scheduler.add_request(request)
        if request.sampling_params.structured_outputs is not None:
            if self._structured is None:
                self._structured = StructuredOutputManager(
                    self.args.model, self.model_config.vocab_size, request.eos_token_ids
                )
            self._scheduler.hold(request.request_id)
            self._structured.submit(request)

    def abort_requests(self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        request_ids = list(request_ids)
        for request_id in request_ids:
            self._scheduler.finish_request(request_id, status)
        if self._structured is not None:
            self._structured.drop(request_ids)
        self.publish_kv_events()  # an aborted grant's unwritten blocks left the cache: say so now, idle or not

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or finished ones the workers have not been told of (one more step)."""
        return self._scheduler.has_unfinished_requests() or self._scheduler.has_unsent_diffs()

    def has_pending_kv_transfers(self) -> bool:
        """Disaggregation's reads and leases the workers must keep reporting on: a serving loop steps while
        there are any, also with no request left (a prefill instance's lease ends when a decode instance's
        read is reported, or in time)."""
        return self._scheduler.has_pending_kv_transfers()

    def step(self) -> EngineCoreOutputs:
        outputs = self._step()
        self.publish_kv_events()
        return outputs

    def publish_kv_events(self) -> None:
        """Send what entered and left the prefix cache; to a subscriber that has just joined (and to every
        other, idempotently), the whole cache instead. The serving loop calls it when idle, so a router that
        subscribes to an idle replica learns what it holds."""
        if self._kv_events is None:
            return
        if self._kv_events.take_snapshot_request():
            self._scheduler.take_kv_events()  # included in the snapshot
            events = self._scheduler.kv_snapshot_events()
            for start in range(0, len(events), _SNAPSHOT_EVENTS_PER_BATCH):
                self._kv_events.publish(events[start : start + _SNAPSHOT_EVENTS_PER_BATCH])
        else:
            self._kv_events.publish(self._scheduler.take_kv_events())

    def _step(self) -> EngineCoreOutputs:
        start = time.perf_counter()
        scheduler, structured = self._scheduler, self._structured
        try:
            outputs = self._admit_compiled_grammars()
            plan = scheduler.schedule()
            if not plan.has_work:
                if structured is not None and structured.has_pending():
                    structured.wait(_GRAMMAR_WAIT_S)  # nothing else to do: don't spin meanwhile
                return EngineCoreOutputs(tuple(outputs), scheduler.stats())
            grammar_start = time.perf_counter()
            grammar = structured.bitmask(plan) if structured is not None else None
            grammar_s = time.perf_counter() - grammar_start
            try:
                runner_output = self.executor.execute_model(plan, grammar)
            except StepFault as fault:  # failed on the device: the requests it touched fail
                logger.error("engine step failed; failing the requests of that step", exc_info=fault)
                self.executor.reset_encoder_cache()
                outputs += scheduler.fail_step(fault.request_ids, _FAILED)
                self._forget_finished_grammars()
                return EngineCoreOutputs(tuple(outputs), scheduler.stats())
            updated = scheduler.update(plan, runner_output)
            grammar_start = time.perf_counter()
            outputs += self._apply_grammars(updated)
            grammar_s += time.perf_counter() - grammar_start
        except EngineFatalError:
            raise
        except Exception:  # state unknown: every request in flight fails, not the engine
            logger.exception("engine step failed; failing the requests in flight")
            scheduler.forget_cached_state()
            self.executor.reset_encoder_cache()
            failed = scheduler.fail_requests(scheduler.request_ids(), _FAILED)
            self._forget_finished_grammars()
            return EngineCoreOutputs(tuple(failed), scheduler.stats())
        record = None
        if not plan.is_empty or plan.encoder_work:
            duration_s = time.perf_counter() - start
            features = StepFeatures.of_plan(plan)  # one pass over the plan for the model and the record
            scheduler.record_step_time(features, duration_s)  # the step-time model's online correction
            record = StepRecord(
                duration_s,
                runner_output.encoder_s,
                plan.num_decode_tokens,
                plan.num_prefill_tokens,
                plan.num_encoder_tokens,
                features.num_seqs,
                features.context_tokens,
                runner_output.forward_s,
                runner_output.sampling_s,
                runner_output.comm_bytes,
                grammar_s,
            )
        return EngineCoreOutputs(tuple(outputs), scheduler.stats(), record)

    def has_pending_grammars(self) -> bool:
        """Requests held until their grammar compiles: the engine is waiting, not stuck."""
        return self._structured is not None and self._structured.has_pending()

    def _admit_compiled_grammars(self) -> list[EngineCoreOutput]:
        """Release the requests whose grammar is ready; fail those whose grammar could not compile."""
        if self._structured is None:
            return []
        ready, failed = self._structured.take_ready()
        for request_id in ready:
            self._scheduler.release(request_id)
        outputs: list[EngineCoreOutput] = []
        for failure in failed:
            outputs += self._scheduler.fail_requests([failure.request_id], failure.message)
        return outputs

    def _apply_grammars(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Advance the matchers on this step's tokens: a request whose grammar is complete ends now
        ("stop"), one whose token broke its grammar fails."""
        if self._structured is None:
            return outputs
        complete, failed = self._structured.advance(outputs)
        if not complete and not failed:
            return outputs
        messages = {f.request_id: f.message for f in failed}
        for request_id in complete:
            self._scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        for request_id in messages:
            self._scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        stop, error = RequestStatus.FINISHED_STOPPED.finish_reason, RequestStatus.FINISHED_ERROR.finish_reason
        return [
            dataclasses.replace(out, finish_reason=stop)
            if out.request_id in complete
            else dataclasses.replace(out, finish_reason=error, error=messages[out.request_id])
            if out.request_id in messages
            else out
            for out in outputs
        ]

    def _forget_finished_grammars(self) -> None:
        if self._structured is not None:
            live = set(self._scheduler.request_ids())
            self._structured.drop([r for r in self._structured.request_ids() if r not in live])

    def call_utility(self, method: str, args: tuple[Any, ...] = ()) -> Any:
        if method not in self.UTILITIES:
            raise ValueError(f"unknown engine utility {method!r}")
        return getattr(self, method)(*args)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (only the blocks no request holds are dropped from the cache)."""
        self._scheduler.reset_prefix_cache()
        self.publish_kv_events()
        return True

    def inject_faults(self, action: str, request_ids: Iterable[str] = ()) -> None:
        self.executor.inject_faults(action, tuple(request_ids))

    def _encoder_depth(self) -> int:
        """The vision tower's blocks, which the scheduler may spread over several steps (a slice each); 0 (each
        group encoded whole) without a tower, or with several ranks in the tower's data mode, which splits the
        step's work over them by whole groups (in weights mode every rank runs every block: slices work alike)."""
        vision_config = getattr(self.hf_config, "vision_config", None)
        if vision_config is None or (self.tensor_parallel_size > 1 and self.args.mm_encoder_tp_mode != "weights"):
            return 0
        return int(vision_config.depth)

    def leak_report(self) -> dict[str, int]:
        """What is still held across the scheduler and the workers; every figure is 0 when idle."""
        stats = self._scheduler.stats()
        runner_requests, encoder_keys = self.executor.held_state()
        not_cached, referenced = self._scheduler.encoder_entries_unaccounted(encoder_keys)
        return {
            "requests": len(self._scheduler.request_ids()),
            "kv_blocks_held": stats.num_total_blocks - stats.num_free_blocks,
            "encoder_tokens_referenced": stats.num_referenced_encoder_tokens,
            "encoder_partial_groups": stats.num_partial_encodes,
            "runner_requests": runner_requests,
            "runner_encoder_entries_not_cached": not_cached,
            "runner_encoder_entries_referenced": referenced,
            "grammar_matchers": self._structured.num_live() if self._structured is not None else 0,
            "kv_leases": stats.num_kv_leases,
            "kv_reads": stats.num_loading_remote_kv,
        }

    def stats(self) -> SchedulerStats:
        return self._scheduler.stats()

    def check_health(self) -> None:
        """Raises `EngineFatalError` if a worker (a tensor-parallel rank) is gone; cheap, call it often."""
        self.executor.check_health()

    def close(self) -> None:
        """Stop the workers (tensor-parallel ranks); the core is unusable after."""
        if self._structured is not None:
            self._structured.close()
        if self._kv_events is not None:
            self._kv_events.close()
        self.executor.close()

    def _num_kv_blocks(self) -> int:
        args = self.args
        if args.num_kv_blocks is not None:
            return args.num_kv_blocks
        block_bytes = ModelRunner.kv_bytes_per_block(
            self.model_config, args.block_size, self.kv_cache_dtype, self.tensor_parallel_size
        )
        memory = args.kv_cache_memory
        if memory is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                weight_bytes = _approx_weight_bytes(self.model_config, self.dtype, args.quant_compute, self.device)
                weight_bytes //= self.tensor_parallel_size
                memory = int((free - weight_bytes) * _GPU_KV_CACHE_FRACTION)
            else:
                # No more than every sequence at full length needs, capped by a fixed budget.
                full = -(-self.model_config.max_position_embeddings // args.block_size) * args.max_num_seqs
                return max(1, min(_CPU_KV_CACHE_MEMORY // block_bytes, full))
        num_blocks = memory // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={memory} bytes holds no KV block of {block_bytes} bytes")
        return num_blocks


def _approx_weight_bytes(cfg: DecoderConfig, dtype: torch.dtype, quant_compute: str | None = None,
                         device: torch.device = CPU) -> float:  # fmt: skip
    """The decoder's weights (not yet loaded when the pool is sized): attention, each layer's MLP (the dense
    one, or the router and every expert of a MoE layer: most of a MoE model), the embeddings. A quantized
    checkpoint's projections count as `quant_compute`'s path holds them on `device` (their first layer's scheme
    stands for every layer's)."""
    h, d = cfg.hidden_size, cfg.head_dim
    # (checkpoint name, [N, K] of the projection)
    attention = [("self_attn.q_proj", cfg.num_heads * d, h), ("self_attn.k_proj", cfg.num_kv_heads * d, h),
                 ("self_attn.v_proj", cfg.num_kv_heads * d, h), ("self_attn.o_proj", h, cfg.num_heads * d)]  # fmt: skip
    dense_mlp = [("mlp.gate_proj", cfg.intermediate_size, h), ("mlp.up_proj", cfg.intermediate_size, h),
                 ("mlp.down_proj", h, cfg.intermediate_size)]  # fmt: skip

    def held(projections: list[tuple[str, int, int]]) -> float:
        total = 0.0
        for name, n, k in projections:
            scheme = None
            if cfg.quantization is not None:
                scheme = cfg.quantization.scheme_for(f"model.layers.0.{name}", f"model.language_model.layers.0.{name}")
            per_weight = float(dtype.itemsize)
            if scheme is not None:
                path = resolve_compute_path(scheme, quant_compute, device)
                per_weight = held_bytes_per_weight(scheme, path, dtype, k)
            total += n * k * per_weight
        return total

    moe_mlp = cfg.num_experts * (3 * h * cfg.moe_intermediate_size + h) * dtype.itemsize
    num_moe = len(cfg.moe_layers)
    layers = held(attention) * cfg.num_layers + held(dense_mlp) * (cfg.num_layers - num_moe) + moe_mlp * num_moe
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) * dtype.itemsize
    return layers + embeddings
