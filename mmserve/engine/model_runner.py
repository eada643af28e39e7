"""Runs one plan on the device: builds the `ForwardBatch`, owns the KV cache tensors, runs the decoder
over all scheduled tokens (prefill chunks and decodes together), samples, and syncs with the host once."""

from __future__ import annotations

from pathlib import Path

import torch

from mmserve.engine.forward_batch import ForwardBatch
from mmserve.engine.sampler import Sampler, SamplingMetadata
from mmserve.kernels.dispatch import get_attention_backend
from mmserve.models.config import DecoderConfig
from mmserve.models.loader import load_decoder_weights
from mmserve.models.qwen2 import MRotaryEmbedding, Qwen2Decoder
from mmserve.scheduler.output import ModelRunnerOutput, SchedulerOutput


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        cfg: DecoderConfig,
        device: torch.device,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
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

    @staticmethod
    def kv_bytes_per_block(cfg: DecoderConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        batch = self._prepare(plan)
        hidden = self.model(batch, self.kv_caches)  # [num_tokens, hidden]
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

    def _prepare(self, plan: SchedulerOutput) -> ForwardBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        max_blocks = max(len(s.block_ids) for s in plan.scheduled)
        block_tables = []
        for s in plan.scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
            input_ids.extend(s.token_ids)
            # Text-only positions; media prompts bring their own 3-D positions with the encoder work.
            positions.extend(range(start + s.mrope_delta, end + s.mrope_delta))
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + s.num_scheduled_tokens)
            seq_lens.append(end)
            if s.sample:
                logits_indices.append(query_start_loc[-1] - 1)
            block_tables.append(list(s.block_ids) + [0] * (max_blocks - len(s.block_ids)))
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=pos.expand(3, -1),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(block_tables, dtype=torch.long, device=dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
        )
