"""Runs one plan on the device: builds the `ForwardBatch`, owns the KV cache tensors, runs the decoder
over all scheduled tokens (prefill chunks and decodes together), samples, and syncs with the host once.

Plans are incremental: the runner keeps each running request's token ids, block table and inputs
(`RequestStates`) and applies each plan's diffs.

Fault attribution: each request's inputs are built on the host before any device work; a request whose
inputs fail to build is left out of the step (`ModelRunnerOutput.failed`) and the rest runs. An exception
once device work has begun is raised as `StepFault` naming every request of the step.

Tensor parallelism: each rank runs one runner over its shard of the decoder (`tp`), on the same plans;
every rank builds the same inputs, and only the first rank samples. The vision tower runs in data mode:
replicated weights, the step's encoder work split over the ranks (`encoder_split`), the embeddings
all-gathered with each rank's status, so a failed encode fails the step on every rank alike."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import PretrainedConfig

from mmserve.distributed.group import TensorParallelGroup
from mmserve.encoders.vision import PartialEncode, VisionTower
from mmserve.engine.decode_graphs import DecodeGraphs, choose_mode
from mmserve.engine.ec_connector import SharedEncoderStore
from mmserve.engine.encoder_split import EncoderRun, encoder_runs, split_encoder_work
from mmserve.engine.faults import EncoderFailed, FaultInjector, InjectedFault, StepFault
from mmserve.engine.huge_pages import move_to_huge_pages
from mmserve.engine.sampler import GrammarBitmask, Sampler, SamplingMetadataCache
from mmserve.engine.step_inputs import StepInputBuffer
from mmserve.kernels import cpu_decoder
from mmserve.kernels.cpu_linear import choose_paths
from mmserve.kernels.dispatch import (
    get_attention_backend,
    get_elementwise_ops,
    get_moe_backend,
    get_w4a16_backend,
)
from mmserve.kernels.launch_plan import LaunchPlan
from mmserve.kernels.reference import decode_row_values, decode_seqs
from mmserve.models.config import DecoderConfig
from mmserve.models.decoder import DeepStackInput, rotary_embedding
from mmserve.models.forward_batch import ForwardBatch
from mmserve.models.loader import load_decoder
from mmserve.models.parallel import kv_head_range
from mmserve.scheduler.output import EncoderWork, FailedRequest, ModelRunnerOutput, SchedulerOutput
from mmserve.scheduler.plan_state import RequestStates, StepView

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Rows:
    """One scheduled request's share of the forward batch, built on the host."""

    positions: list[int]  # [num_scheduled_tokens] 1-D positions (media prompt rows overwritten by mrope)
    mrope: tuple[int, object, int] | None  # (number of prompt rows, [3, prompt] positions, from) or None
    slots: list[int]  # [num_scheduled_tokens] KV slot of each token


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        cfg: DecoderConfig,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        hf_config: PretrainedConfig | None = None,
        tp: TensorParallelGroup | None = None,
        mm_encoder_tp_mode: str = "data",
        kv_cache_dtype: torch.dtype | None = None,
        calculate_kv_scales: bool = False,
        quant_compute: str | None = None,
        encoder_store: SharedEncoderStore | None = None,
        store_encoder_outputs: bool = False,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        cuda_graph_sizes: tuple[int, ...] = (),
    ) -> None:
        """`mm_encoder_tp_mode` (several ranks): "data", the tower replicated and the step's media split
        over the ranks; "weights", the tower sharded like the decoder and every item encoded by all.
        `kv_cache_dtype`: the KV cache's element type (an FP8 one: `kernels/fp8.py`); None: `dtype`.
        `calculate_kv_scales`: an FP8 cache's scales come from the first step's K/V, not the checkpoint.
        `quant_compute`: a quantized checkpoint's compute path, auto | dequantized | native (None:
        $MMSERVE_QUANT_COMPUTE, else auto; models/quant/linear.py).
        `encoder_store`: encoder disaggregation's shared directory (one rank only): groups planned as loads come
        from it; `store_encoder_outputs` (an encoder instance): every group this runner encodes goes into it.
        `enforce_eager`: no decode graphs; else they are captured at `cuda_graph_sizes` where they can run
        (`engine/decode_graphs.py`; the core's choice, needed when graphs run), for contexts up to
        `max_model_len` (None: the checkpoint's positions)."""
        self.cfg, self.device, self.dtype, self.block_size = cfg, device, dtype, block_size
        self.tp = tp = tp or TensorParallelGroup.single()
        self.backend = get_attention_backend(device)
        fused_moe = get_moe_backend(device).fused_moe if cfg.moe_layers else None
        # Quantized layers keep their codes (integer tensors) and fp32 scales through the cast.
        quant_kernels = {} if cfg.quantization is None else {"w4a16_linear": get_w4a16_backend(device).w4a16_linear}
        model = load_decoder(model_dir, cfg, self.backend, tp, fused_moe, quant_compute, device=torch.device(device),
                             **quant_kernels)  # fmt: skip
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        # On the CPU the weights move to huge pages (engine/huge_pages.py): the region lives as long as the runner.
        self.weight_region = move_to_huge_pages(self.model) if self.device.type == "cpu" else None
        # Rebuilt after the cast: the frequency buffers must stay fp32 whatever the weights' dtype.
        self.model.rotary = rotary_embedding(cfg).to(device)
        # On the CPU, the product each decode row count takes: measured once per machine and model, cached.
        self.linear_paths = choose_paths(torch.device(device), self.model.linear_weights())
        self.model.set_linear_paths(self.linear_paths)
        self.model.set_elementwise_ops(get_elementwise_ops(torch.device(device)))
        # One pool per layer, this rank's KV heads: [2, num_blocks, block_size, num_kv_heads, head_dim]
        _, num_kv_heads = kv_head_range(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.world_size)
        shape = (2, num_blocks, block_size, num_kv_heads, cfg.head_dim)
        self.kv_cache_dtype = kv_cache_dtype or dtype
        if calculate_kv_scales:
            self.model.calibrate_kv_scales()
        blockers = self._decode_graph_blockers(calculate_kv_scales, store_encoder_outputs)
        self.decode_graph_mode = choose_mode(torch.device(device), enforce_eager, blockers)
        # With decode graphs, one more block than the plans use: the pad rows' scratch block (its id: num_blocks).
        shape = (2, num_blocks + (self.decode_graph_mode != "off"), *shape[2:])
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_cache_dtype, device=device) for _ in range(cfg.num_layers)]
        self.decode_stack_blocker = self._enable_decode_stack()
        self.sampler = Sampler()
        self.sampling_metadata = SamplingMetadataCache()  # one build per change of the sampled rows
        self.requests = RequestStates()  # what the plans so far have sent of each running request
        self.step_inputs = StepInputBuffer(torch.device(device), step_input_views)  # `_prepare` writes into it
        has_vision = hf_config is not None and getattr(hf_config, "vision_config", None) is not None
        if mm_encoder_tp_mode not in ("data", "weights"):
            raise ValueError(f"mm_encoder_tp_mode must be 'data' or 'weights', got {mm_encoder_tp_mode!r}")
        self.shard_encoder = mm_encoder_tp_mode == "weights" and tp.world_size > 1
        shard_over = tp if self.shard_encoder else None
        self.vision = VisionTower(hf_config, model_dir, device, dtype, shard_over) if has_vision else None
        # (mm_hash, group) -> [tokens, embed_width]: the embeddings, then any DeepStack levels (vision.py)
        self.encoder_cache: dict[tuple[str, int], torch.Tensor] = {}
        # (mm_hash, group) -> its hidden states part-way through the tower (the scheduler's slices of blocks)
        self.partial_encodes: dict[tuple[str, int], PartialEncode] = {}
        self.faults = FaultInjector.from_env()  # test hook; inert unless armed
        self.encoder_store = encoder_store
        self.store_encoder_outputs = store_encoder_outputs and encoder_store is not None
        self.decode_graphs: DecodeGraphs | None = None
        if self.decode_graph_mode != "off":
            self.decode_graphs = self._capture_decode_graphs(num_blocks, max_model_len or cfg.max_position_embeddings,
                                                             cuda_graph_sizes)  # fmt: skip

    def _enable_decode_stack(self) -> str | None:
        """On the CPU, decode steps run the decoder as one C call where they can (`Decoder.enable_decode_stack`);
        $MMSERVE_CPU_DECODE_STACK=0 keeps every layer composed. Returns why not, or None."""
        if self.device.type != "cpu":
            return "not on the CPU"
        if os.environ.get(cpu_decoder.ENV, "1").strip().lower() in ("0", "off", "false", "no"):
            return f"{cpu_decoder.ENV}=0"
        blocker = self.model.enable_decode_stack(self.kv_cache_dtype)
        if blocker is not None:
            logger.info("decode steps run layer by layer: %s", blocker)
        return blocker

    def _decode_graph_blockers(self, calculate_kv_scales: bool, encode_only: bool) -> list[str]:
        """Why this runner's decode steps cannot be captured as graphs (none: they can)."""
        blockers = []
        if self.backend.decode_graph_metadata is None:
            blockers.append(f"the {self.backend.name} attention plans from host lists (graphs need triton's)")
        if self.tp.world_size > 1:
            blockers.append("tensor parallelism (its collectives are not captured yet)")
        if self.cfg.moe_layers:
            blockers.append("MoE layers (their expert routing is not checked for capture)")
        if self.cfg.quantization is not None:
            blockers.append("a quantized checkpoint (its layers' compute paths are not checked for capture)")
        if calculate_kv_scales:
            blockers.append("FP8 KV scales calibrated from the first step (a capture would calibrate on pads)")
        if encode_only:
            blockers.append("an encoder instance (it decodes nothing)")
        return blockers

    def _capture_decode_graphs(self, num_blocks: int, max_model_len: int, sizes: tuple[int, ...]) -> DecodeGraphs:
        metadata = self.backend.decode_graph_metadata
        assert metadata is not None
        cfg, start = self.cfg, time.perf_counter()

        def graph_metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> LaunchPlan:
            return metadata(query_start_loc, seq_lens, cfg.num_heads, cfg.num_kv_heads, max_model_len)

        model, kv_caches = self.model, self.kv_caches  # not `self`: the graphs would hold the runner in a cycle

        def forward(batch: ForwardBatch) -> torch.Tensor:
            return model(batch, kv_caches)

        graphs = DecodeGraphs(
            forward,
            graph_metadata,
            mode=self.decode_graph_mode,
            sizes=sizes,
            max_blocks_per_seq=-(-max_model_len // self.block_size),
            scratch_block=num_blocks,
            block_size=self.block_size,
            device=torch.device(self.device),
        )
        logger.info("decode graphs (%s) at batch sizes %s in %.1f s", self.decode_graph_mode,
                    ", ".join(map(str, graphs.sizes)), time.perf_counter() - start)  # fmt: skip
        return graphs

    @staticmethod
    def kv_bytes_per_block(cfg: DecoderConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
        """Bytes one KV block takes on each rank (each holds its KV heads; replicated ones count whole)."""
        _, num_kv_heads = kv_head_range(cfg.num_heads, cfg.num_kv_heads, 0, tp_size)
        return 2 * cfg.num_layers * block_size * num_kv_heads * cfg.head_dim * dtype.itemsize

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Runs the plan minus the requests whose inputs fail to build (`failed` in the output). Raises
        `StepFault` if the step fails after device work began. `grammar`: the token masks of the
        constrained requests (a request of it that does not sample in this step is skipped)."""
        for key in plan.freed_encoder_keys:
            self.encoder_cache.pop(key, None)
            self.partial_encodes.pop(key, None)
        try:
            views = self.requests.apply(plan)
        except ValueError as exc:  # a plan that contradicts the ones before it: nothing can be trusted
            raise StepFault(frozenset(s.request_id for s in plan.scheduled), exc) from exc
        views, rows, failed = self._build_rows(views)
        touched = frozenset({v.request_id for v in views} | {f.request_id for f in failed})
        try:  # the requests left out fail with the step: nothing reports them now
            self.faults.check_step()
            if self.tp.world_size == 1:
                return self._execute(plan, views, rows, tuple(failed), grammar)
            self.tp.take_stats()  # this step's collectives only
            out = self._execute(plan, views, rows, tuple(failed), grammar)
            comm = self.tp.take_stats()
            return dataclasses.replace(
                out, comm_bytes=comm.all_reduce_bytes + comm.all_gather_bytes + comm.gather_bytes
            )
        except (InjectedFault, EncoderFailed) as exc:  # raised alike on every rank, before or between collectives
            raise StepFault(touched, exc) from exc
        except Exception as exc:  # with several ranks, they may now be at different collectives
            raise StepFault(touched, exc, ranks_agree=self.tp.world_size == 1) from exc

    def decode_graph_summary(self) -> tuple[str, tuple[int, ...], dict[int, int]]:
        """(mode, captured batch sizes, steps replayed at each size so far); ("off", (), {}) without graphs."""
        graphs = self.decode_graphs
        return (self.decode_graph_mode, graphs.sizes, dict(graphs.replays)) if graphs else ("off", (), {})

    def reset_encoder_cache(self) -> None:
        self.encoder_cache.clear()
        self.partial_encodes.clear()

    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds: its decoder shard, plus the whole vision tower. Parameters and
        persistent buffers: a quantized layer's codes, scales and zero points are buffers, as stored (int4 packed
        8 to a word, fp8 / int8 one byte each); derived tables (rotary frequencies, KV scales) are not counted."""
        modules = [m for top in [self.model] + ([self.vision.model] if self.vision else []) for m in top.modules()]
        buffers = [b for m in modules for n, b in m._buffers.items() if b is not None and n not in m._non_persistent_buffers_set]
        unique = {id(t): t for t in (*[p for m in modules for p in m.parameters(recurse=False)], *buffers)}
        return sum(t.numel() * t.element_size() for t in unique.values())  # tied weights once

    def held_state(self) -> tuple[int, list[tuple[str, int]]]:
        """(requests whose plan state is kept, the keys of the encoder cache and of the partial encodes)."""
        return len(self.requests), [*self.encoder_cache, *self.partial_encodes]

    def _build_rows(self, views: list[StepView]) -> tuple[list[StepView], list[_Rows], list[FailedRequest]]:
        """Each request's rows, built alone so that an error is that request's. A request whose prefill
        shares a block that a failed request was to write in this step fails with it (it would read KV
        that is never written). Returns the views that run, their rows, and the failed."""
        rows: dict[str, _Rows] = {}
        failed: list[FailedRequest] = []
        errors: list[BaseException] = []
        for v in views:
            try:
                self.faults.check_request(v.request_id)
                rows[v.request_id] = self._rows(v)
            except Exception as exc:  # attributed to this request; the engine reports it
                failed.append(FailedRequest(v.request_id, v.start, f"{type(exc).__name__}: {exc}"))
                errors.append(exc)
        if failed:
            bs = self.block_size
            failed_ids = {f.request_id for f in failed}
            unwritten = {
                b
                for v in views
                if v.request_id in failed_ids
                for b in v.state.block_ids[v.start // bs : -(-v.end // bs)]
            }
            for v in views:
                if v.request_id in rows and unwritten.intersection(v.state.block_ids):
                    del rows[v.request_id]
                    message = "shares KV blocks with a request that failed in the same step"
                    failed.append(FailedRequest(v.request_id, v.start, message))
                    errors.append(RuntimeError(message))
            for f, error in zip(failed, errors, strict=True):
                logger.error("request %s failed while building its inputs", f.request_id, exc_info=error)
            for f in failed:  # the scheduler finishes them; their state here is dropped now
                self.requests.drop(f.request_id)
        kept = [v for v in views if v.request_id in rows]
        return kept, [rows[v.request_id] for v in kept], failed

    def _execute(
        self,
        plan: SchedulerOutput,
        views: list[StepView],
        rows: list[_Rows],
        failed: tuple[FailedRequest, ...],
        grammar: GrammarBitmask | None = None,
    ) -> ModelRunnerOutput:
        start = time.perf_counter()
        self._run_encoder(plan.encoder_work)
        if plan.encoder_work and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # time the encoder itself (profiling only when it ran)
        encoder_s = time.perf_counter() - start if plan.encoder_work else 0.0
        if not views:  # only encoder work (its requests were preempted after planning it, or failed)
            return ModelRunnerOutput((), (), (), failed, encoder_s)
        forward_start = time.perf_counter()
        batch = self._prepare(views, rows)
        embeds, deepstack = self._embeddings(views, batch)
        graphs = self.decode_graphs
        size = graphs.size_for(batch) if graphs is not None and embeds is None and deepstack is None else None
        if size is not None:  # a pure-decode step: replayed at the next captured size
            hidden = graphs.run(batch, size)  # type: ignore[union-attr]  # [num_tokens, hidden]
        else:
            hidden = self.model(batch, self.kv_caches, embeds, deepstack)  # [num_tokens, hidden]
        sampled = [v for v in views if v.scheduled.sample]
        # [num_sampled, vocab] fp32 on the first rank; None on the others (and when nothing samples)
        # Every row sampled (decodes alone) means logits_indices is 0..n-1: no gather then.
        sampled_hidden = hidden if len(sampled) == hidden.shape[0] else hidden[batch.logits_indices]
        logits = self.model.compute_logits(sampled_hidden) if sampled else None
        sampling_start = time.perf_counter()
        if logits is None:  # a prefill chunk that samples nothing, or a rank that does not sample
            return ModelRunnerOutput((), (), (), failed, encoder_s, sampling_start - forward_start, 0.0)
        metadata = self.sampling_metadata.build(
            [v.state.data.sampling_params for v in sampled],
            [v.num_output_tokens for v in sampled],
            self.device,
            token_ids=[v.state.token_ids for v in sampled],  # prompt + outputs, read only by the penalties
            eos_token_ids=self.cfg.eos_token_ids,
            vocab_size=logits.shape[1],
            grammar=grammar.for_rows([v.request_id for v in sampled]) if grammar is not None else None,
        )
        out = self.sampler(logits, metadata)
        token_ids, lp_ids, lps = out.token_ids, out.logprob_token_ids, out.logprobs
        if self.device.type != "cpu":  # the step's only host sync: copy every result at once
            token_ids, lp_ids, lps = (
                t.to("cpu", non_blocking=True) if t is not None else None for t in (token_ids, lp_ids, lps)
            )
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        logprobs: list[dict[int, float] | None] = []
        for row, v in enumerate(sampled):
            k = v.state.data.sampling_params.logprobs
            if k is None or lp_ids is None or lps is None:
                logprobs.append(None)
            else:
                logprobs.append(
                    dict(zip(lp_ids[row, : k + 1].tolist(), lps[row, : k + 1].tolist(), strict=True))
                )
        end = time.perf_counter()
        return ModelRunnerOutput(
            request_ids=tuple(v.request_id for v in sampled),
            sampled_token_ids=tuple(token_ids.tolist()),
            logprobs=tuple(logprobs),
            failed=failed,
            encoder_s=encoder_s,
            forward_s=sampling_start - forward_start,
            sampling_s=end - sampling_start,
        )

    def _run_encoder(self, work: tuple[EncoderWork, ...]) -> None:
        """Encode the planned temporal groups (and slices of the tower over some); consecutive groups of one item
        go in one call. With several ranks in data mode each encodes its share and every rank caches all of the
        step's embeddings; in weights mode every rank runs all of it, the tower's collectives inside."""
        if not work:
            return
        slices = [w for w in work if w.blocks is not None]
        work = tuple(w for w in work if w.blocks is None)
        if slices and self.tp.world_size > 1 and not self.shard_encoder:  # EngineCore plans none in data mode
            raise ValueError("a slice of the vision tower was planned for ranks that split the work by whole groups")
        runs = encoder_runs(work) if self.shard_encoder else []
        if self.shard_encoder:  # every rank runs every block, the tower's collectives inside: all agree first
            self._agree_on_encoder_inputs(runs, slices)
        for w in slices:
            self._encode_slice(w, checked=self.shard_encoder)
        if not work:
            return
        if self.tp.world_size == 1:
            if self.encoder_store is not None:
                work = self._load_stored(work)
            for run in encoder_runs(work):
                self._cache_run(run, self._encode_run(run))
                if self.encoder_store is not None and self.store_encoder_outputs:
                    for group in range(run.first, run.first + run.count):
                        key = (run.mm_input.mm_hash, group)
                        self.encoder_store.save(key, self.encoder_cache[key])
            return
        if self.shard_encoder:  # weights mode: every rank runs every item (inputs agreed on above)
            for run in runs:
                self._cache_run(run, self._encode_run(run, checked=True))
            return
        shares = split_encoder_work(work, self.tp.world_size)
        width = max(sum(run.num_tokens for run in share) for share in shares)
        embed_width = self.vision.embed_width if self.vision is not None else self.cfg.hidden_size
        padded = torch.zeros(width, embed_width, dtype=self.dtype, device=self.device)
        status = torch.zeros(1, dtype=torch.int32)
        try:
            row = 0
            for run in shares[self.tp.rank]:
                embeds = self._encode_run(run)
                if embeds.shape[0] != run.num_tokens:
                    raise ValueError(f"{embeds.shape[0]} embeddings for {run.num_tokens} placeholder tokens")
                padded[row : row + run.num_tokens] = embeds
                row += run.num_tokens
        except Exception:  # every rank learns of it from the status it gathers, and fails the step alike
            logger.exception("rank %d failed to encode its share of the step's media", self.tp.rank)
            status[0] = 1
        statuses = self.tp.all_gather(status)
        gathered = self.tp.all_gather(padded)  # [world_size] x [width, embed_width]
        failed_ranks = [rank for rank, s in enumerate(statuses) if int(s[0])]
        if failed_ranks:
            raise EncoderFailed(f"ranks {failed_ranks} failed to encode their share of the step's media")
        for share, embeds in zip(shares, gathered, strict=True):
            row = 0
            for run in share:  # copies: a view would keep the whole padded buffer alive in the cache
                self._cache_run(run, embeds[row : row + run.num_tokens].clone())
                row += run.num_tokens

    def _load_stored(self, work: tuple[EncoderWork, ...]) -> tuple[EncoderWork, ...]:
        """Cache the groups planned as loads that the store still holds; the rest (and any it lost) to encode."""
        assert self.encoder_store is not None
        to_encode = []
        for w in work:
            key, tokens = (w.mm_input.mm_hash, w.group), w.mm_input.tokens_per_group
            embeds = self.encoder_store.load(key, tokens, self.device, self.dtype) if w.load else None
            if embeds is None:
                to_encode.append(w)
            else:
                self.encoder_cache[key] = embeds
        return tuple(to_encode)

    def _agree_on_encoder_inputs(self, runs: list[EncoderRun], slices: Sequence[EncoderWork] = ()) -> None:
        """Weights mode: every rank checks the inputs of every run and slice before the tower's first collective
        and all learn whether any failed (one small all-gather), so a bad input fails the step alike."""
        status = torch.zeros(1, dtype=torch.int32)
        try:
            if self.vision is None:
                raise ValueError("this model has no vision tower, but a request carries media")
            self.faults.check_encode(self.tp.rank)
            for run in runs:
                run.mm_input.data.groups(run.first, run.first + run.count - 1)  # type: ignore[attr-defined]
            for w in slices:
                self._check_slice(w)
        except Exception:
            logger.exception("rank %d cannot encode the step's media", self.tp.rank)
            status[0] = 1
        failed_ranks = [rank for rank, s in enumerate(self.tp.all_gather(status)) if int(s[0])]
        if failed_ranks:
            raise EncoderFailed(f"ranks {failed_ranks} cannot encode the step's media")

    def _encode_run(self, run: EncoderRun, checked: bool = False) -> torch.Tensor:
        """-> [run.num_tokens, embed_width] embeddings. `checked`: inputs and fault hook already checked."""
        if self.vision is None:
            raise ValueError("this model has no vision tower, but a request carries media")
        if not checked:
            self.faults.check_encode(self.tp.rank)
        pixels, grid = run.mm_input.data.groups(run.first, run.first + run.count - 1)
        return self.vision.encode(pixels, grid)

    def _check_slice(self, work: EncoderWork) -> None:
        """Raises unless the slice can run here: a tower of its depth, and its group's patches (a first slice)
        or its partial encode at the slice's first block."""
        assert work.blocks is not None
        first, _, depth = work.blocks
        key = (work.mm_input.mm_hash, work.group)
        if self.vision is None:
            raise ValueError("this model has no vision tower, but a request carries media")
        if depth != self.vision.depth:
            raise ValueError(f"a slice of a {depth}-block tower was planned for this {self.vision.depth}-block one")
        if first == 0:
            work.mm_input.data.groups(work.group, work.group)  # type: ignore[attr-defined]
        elif (state := self.partial_encodes.get(key)) is None or state.blocks_done != first:
            done = None if state is None else state.blocks_done
            raise ValueError(f"group {key} was planned from block {first}, but its partial encode is at {done}")

    def _encode_slice(self, work: EncoderWork, checked: bool = False) -> None:
        """Run a slice of the tower's blocks over one temporal group: from its patches (the first slice) or
        from the hidden states the previous slice left; the last slice caches the group's embeddings.
        `checked`: `_check_slice` and the fault hook already ran (weights mode, on every rank)."""
        if not checked:
            self._check_slice(work)
            self.faults.check_encode(self.tp.rank)
        assert work.blocks is not None and self.vision is not None
        first, end, depth = work.blocks
        key = (work.mm_input.mm_hash, work.group)
        state = self.partial_encodes.pop(key, None)
        if first == 0:  # a fresh start (an earlier partial encode of the group, if any, was abandoned)
            pixels, grid = work.mm_input.data.groups(work.group, work.group)  # type: ignore[attr-defined]
            state = self.vision.begin(pixels, grid)
        assert state is not None
        self.vision.advance(state, end - first)
        if end == depth:
            self.encoder_cache[key] = self.vision.finish(state)
        else:
            self.partial_encodes[key] = state

    def _cache_run(self, run: EncoderRun, embeds: torch.Tensor) -> None:
        for k, chunk in enumerate(embeds.split(run.mm_input.tokens_per_group)):
            key = (run.mm_input.mm_hash, run.first + k)
            self.encoder_cache[key] = chunk
            self.partial_encodes.pop(key, None)  # encoded whole after all: an abandoned slice's state goes

    def _embeddings(
        self, views: list[StepView], batch: ForwardBatch
    ) -> tuple[torch.Tensor | None, DeepStackInput | None]:
        """Token embeddings with media embeddings spliced over their placeholder rows, or None when
        no scheduled token is a placeholder (the model then embeds the ids itself); and, for towers with
        DeepStack levels, those levels' rows of the scheduled placeholder tokens.

        An encoder cache entry is [tokens, hidden * (1 + levels)]: the embeddings, then each level."""
        embeds = None
        hidden = self.cfg.hidden_size
        levels = self.cfg.num_deepstack_levels
        visual_rows: list[torch.Tensor] = []
        visual_levels: list[torch.Tensor] = []  # [tokens, levels * hidden] each
        row = 0
        for v in views:
            start, end = v.start, v.end
            for mm in v.state.data.mm_inputs:
                first, last = mm.placeholder.offset, mm.placeholder.offset + mm.placeholder.length
                if last <= start or first >= end:
                    continue
                if embeds is None:
                    embeds = self.model.embed_tokens(batch.input_ids)
                tokens = mm.tokens_per_group
                for group in range(
                    (max(start, first) - first) // tokens, (min(end, last) - 1 - first) // tokens + 1
                ):
                    g0, g1 = mm.group_range(group)
                    a, b = max(start, g0), min(end, g1)
                    cached = self.encoder_cache[(mm.mm_hash, group)]
                    embeds[row + a - start : row + b - start] = cached[a - g0 : b - g0, :hidden]
                    if levels:
                        visual_rows.append(torch.arange(row + a - start, row + b - start))
                        visual_levels.append(cached[a - g0 : b - g0, hidden:])
            row += end - start
        if not visual_rows:
            return embeds, None
        stacked = torch.cat(visual_levels).view(-1, levels, hidden).transpose(0, 1)  # [levels, visual, hidden]
        return embeds, DeepStackInput(torch.cat(visual_rows).to(self.device), stacked)

    def _rows(self, v: StepView) -> _Rows:
        bs = self.block_size
        start, end = v.start, v.end
        data, block_ids = v.state.data, v.state.block_ids
        if -(-end // bs) > len(block_ids):
            raise ValueError(f"request {v.request_id}: the plan does not cover its tokens")
        # 1-D positions; media prompt tokens are overwritten with their 3-D positions below.
        positions = list(range(start + data.mrope_delta, end + data.mrope_delta))
        mrope = None
        num_prompt = v.state.num_prompt_tokens
        if data.mrope_positions is not None and start < num_prompt:
            mrope = (min(end, num_prompt) - start, data.mrope_positions, start)
        slots = [block_ids[p // bs] * bs + p % bs for p in range(start, end)]
        return _Rows(positions, mrope, slots)

    def _prepare(self, views: list[StepView], rows: list[_Rows]) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        mrope_rows: list[tuple[int, int, torch.Tensor, int]] = []  # (batch rows, prompt positions, from)
        max_blocks = max(len(v.state.block_ids) for v in views)
        block_tables: list[int] = []  # [num_seqs * max_blocks], row-major
        for v, r in zip(views, rows, strict=True):
            input_ids.extend(v.token_ids)
            positions.extend(r.positions)
            if r.mrope is not None:
                row = query_start_loc[-1]
                num_rows, prompt_positions, start = r.mrope
                mrope_rows.append((row, row + num_rows, prompt_positions, start))  # type: ignore[arg-type]
            slots.extend(r.slots)
            query_start_loc.append(query_start_loc[-1] + v.scheduled.num_scheduled_tokens)
            seq_lens.append(v.end)
            if v.scheduled.sample:
                logits_indices.append(query_start_loc[-1] - 1)
            block_ids = v.state.block_ids
            block_tables += block_ids
            block_tables += [0] * (max_blocks - len(block_ids))
        build_metadata = self.backend.step_metadata  # None: this backend's attention builds its own per layer
        seqs = decode_seqs(query_start_loc) if build_metadata is not None else []
        # One write of the int64 inputs into the runner's persistent buffers (`engine/step_inputs.py`): the five
        # device inputs, then the decodes' lengths and rows (host only). A layout seen before reuses its views.
        layout = (len(input_ids), len(logits_indices), len(views), max_blocks, len(seqs))
        values = input_ids + positions + slots + logits_indices + block_tables
        num_device = len(values)
        values += decode_row_values(seqs, query_start_loc, seq_lens)  # none without metadata (no seqs)
        inputs = self.step_inputs.write(values, num_device, layout)
        pos = inputs.positions
        if mrope_rows:  # [3, num_tokens]: a prompt's media rows have their own t, h and w (built on the host)
            host_positions = torch.tensor(positions, dtype=torch.long).expand(3, -1).clone()
            for r0, r1, prompt_positions, start in mrope_rows:
                host_positions[:, r0:r1] = prompt_positions[:, start : start + r1 - r0]
            pos = host_positions.to(self.device)
        metadata = (
            None
            if build_metadata is None
            else build_metadata(inputs.block_tables, seqs, inputs.decode_seq_lens, inputs.decode_rows)
        )
        return ForwardBatch(
            input_ids=inputs.input_ids,
            positions=pos,
            slot_mapping=inputs.slot_mapping,
            block_tables=inputs.block_tables,
            logits_indices=inputs.logits_indices,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            attention_metadata=metadata,
        )


class StepInputViews(NamedTuple):
    """The tensors of one layout of `_prepare`'s inputs: views of the runner's `StepInputBuffer`."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [3, num_tokens]: the 1-D positions expanded (text rows have equal t, h and w)
    slot_mapping: torch.Tensor  # [num_tokens]
    logits_indices: torch.Tensor  # [num_sampled]
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    decode_seq_lens: torch.Tensor  # [num_decodes] on the host (empty when the backend builds no metadata)
    decode_rows: torch.Tensor  # [num_decodes] on the host


def step_input_views(layout: tuple[int, int, int, int, int], device: torch.Tensor, host: torch.Tensor) -> StepInputViews:
    """`layout`: (num_tokens, num_sampled, num_seqs, max_blocks, num_decodes), as `_prepare` writes them."""
    num_tokens, num_sampled, num_seqs, max_blocks, num_decodes = layout
    ids, positions, slots, logits, tables = device.split([num_tokens] * 3 + [num_sampled, num_seqs * max_blocks])
    lens, rows = host.split([num_decodes, num_decodes])
    return StepInputViews(
        ids, positions.expand(3, -1), slots, logits, tables.view(num_seqs, max_blocks), lens, rows
    )
