"""Runs one plan on the device: builds the `ForwardBatch`, owns the KV cache tensors, runs the decoder
over all scheduled tokens (prefill chunks and decodes together), samples, and syncs with the host once."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import PretrainedConfig

from mmserve.encoders.vision import VisionTower
from mmserve.engine.forward_batch import ForwardBatch
from mmserve.engine.sampler import Sampler, SamplingMetadata
from mmserve.kernels.dispatch import get_attention_backend
from mmserve.models.config import DecoderConfig
from mmserve.models.loader import load_decoder_weights
from mmserve.models.qwen2 import MRotaryEmbedding, Qwen2Decoder
from mmserve.scheduler.output import EncoderWork, ModelRunnerOutput, SchedulerOutput


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
    ) -> None:
        self.cfg, self.device, self.dtype, self.block_size = cfg, device, dtype, block_size
        self.backend = get_attention_backend(device)
        with torch.device("meta"):
            model = Qwen2Decoder(cfg, self.backend)
        model = model.to_empty(device="cpu")
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        load_decoder_weights(model, model_dir)
        self.model = model.to(device=device, dtype=dtype).eval()
        # Rebuilt after the cast: the frequency buffers must stay fp32 whatever the weights' dtype.
        self.model.rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section).to(device)
        # One pool per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.sampler = Sampler()
        self.last_encoder_duration_s = 0.0  # of the last execute()
        has_vision = hf_config is not None and getattr(hf_config, "vision_config", None) is not None
        self.vision = VisionTower(hf_config, model_dir, device, dtype) if has_vision else None
        self.encoder_cache: dict[tuple[str, int], torch.Tensor] = {}  # (mm_hash, group) -> [tokens, hidden]

    @staticmethod
    def kv_bytes_per_block(cfg: DecoderConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        for key in plan.freed_encoder_keys:
            self.encoder_cache.pop(key, None)
        start = time.perf_counter()
        self._run_encoder(plan.encoder_work)
        if plan.encoder_work and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # time the encoder itself (profiling only when it ran)
        self.last_encoder_duration_s = time.perf_counter() - start if plan.encoder_work else 0.0
        if plan.is_empty:  # only encoder work (its requests were preempted after planning it)
            return ModelRunnerOutput((), (), ())
        batch = self._prepare(plan)
        hidden = self.model(batch, self.kv_caches, self._embeddings(plan, batch))  # [num_tokens, hidden]
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [num_sampled, vocab] fp32
        sampled = [s for s in plan.scheduled if s.sample]
        metadata = SamplingMetadata.from_params(
            [s.sampling_params for s in sampled], [s.num_output_tokens for s in sampled], self.device
        )
        out = self.sampler(logits, metadata)
        # The step's only host sync: copy every result at once.
        host = [
            t.to("cpu", non_blocking=True) if t is not None else None
            for t in (out.token_ids, out.logprob_token_ids, out.logprobs)
        ]
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        token_ids, lp_ids, lps = host
        logprobs: list[dict[int, float] | None] = []
        for row, s in enumerate(sampled):
            k = s.sampling_params.logprobs
            if k is None or lp_ids is None or lps is None:
                logprobs.append(None)
            else:
                logprobs.append(
                    dict(zip(lp_ids[row, : k + 1].tolist(), lps[row, : k + 1].tolist(), strict=True))
                )
        return ModelRunnerOutput(
            request_ids=tuple(s.request_id for s in sampled),
            sampled_token_ids=tuple(token_ids.tolist()),
            logprobs=tuple(logprobs),
        )

    def _run_encoder(self, work: tuple[EncoderWork, ...]) -> None:
        """Encode the planned temporal groups; consecutive groups of one item go in one call."""
        i = 0
        while i < len(work):
            mm, first = work[i].mm_input, work[i].group
            j = i + 1
            while j < len(work) and work[j].mm_input is mm and work[j].group == first + (j - i):
                j += 1
            if self.vision is None:
                raise ValueError("this model has no vision tower, but a request carries media")
            pixels, grid = mm.data.groups(first, first + j - i - 1)
            embeds = self.vision.encode(pixels, grid)  # [groups * tokens_per_group, hidden]
            for k, chunk in enumerate(embeds.split(mm.tokens_per_group)):
                self.encoder_cache[(mm.mm_hash, first + k)] = chunk
            i = j

    def _embeddings(self, plan: SchedulerOutput, batch: ForwardBatch) -> torch.Tensor | None:
        """Token embeddings with media embeddings spliced over their placeholder rows, or None when
        no scheduled token is a placeholder (the model then embeds the ids itself)."""
        embeds = None
        row = 0
        for s in plan.scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
            for mm in s.mm_inputs:
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
                    embeds[row + a - start : row + b - start] = cached[a - g0 : b - g0]
            row += s.num_scheduled_tokens
        return embeds

    def _prepare(self, plan: SchedulerOutput) -> ForwardBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        mrope_rows: list[tuple[int, int, torch.Tensor, int]] = []  # (batch rows, prompt positions, from)
        max_blocks = max(len(s.block_ids) for s in plan.scheduled)
        block_tables = []
        for s in plan.scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
            input_ids.extend(s.token_ids)
            # 1-D positions; media prompt tokens are overwritten with their 3-D positions below.
            positions.extend(range(start + s.mrope_delta, end + s.mrope_delta))
            if s.mrope_positions is not None and start < s.num_prompt_tokens:
                row = query_start_loc[-1]
                mrope_rows.append(
                    (row, row + min(end, s.num_prompt_tokens) - start, s.mrope_positions, start)
                )
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + s.num_scheduled_tokens)
            seq_lens.append(end)
            if s.sample:
                logits_indices.append(query_start_loc[-1] - 1)
            block_tables.append(list(s.block_ids) + [0] * (max_blocks - len(s.block_ids)))
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long).expand(3, -1)
        if mrope_rows:
            pos = pos.clone()
            for r0, r1, prompt_positions, start in mrope_rows:
                pos[:, r0:r1] = prompt_positions[:, start : start + r1 - r0]
        pos = pos.to(dev)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=pos,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(block_tables, dtype=torch.long, device=dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
        )
