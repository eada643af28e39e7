"""mmserve's decoder for the Qwen families: Qwen2 / Qwen2.5 text models and the language model of Qwen2-VL /
Qwen2.5-VL (M-RoPE), Llama-style checkpoints (no qkv bias), Qwen3 (per-head q/k norms), Qwen3-MoE (sparse
MLP layers, `models/moe.py`) and the language model of Qwen3-VL / Qwen3-VL-MoE (interleaved M-RoPE,
DeepStack). Attention goes through the paged KV cache kernels; the model knows nothing of requests or
scheduling."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmserve.distributed.group import TensorParallelGroup
from mmserve.kernels import fp8, reference
from mmserve.kernels.cpu_decoder import DecoderShape, DecodeStack, LayerWeights
from mmserve.kernels.cpu_linear import BLAS_PATHS, LinearPaths
from mmserve.kernels.dispatch import TORCH_ELEMENTWISE, AttentionBackend, ElementwiseOps
from mmserve.models.config import DecoderConfig
from mmserve.models.forward_batch import ForwardBatch
from mmserve.models.moe import FusedMoE, SparseMoE
from mmserve.models.parallel import (
    ColumnParallelLinear,
    OutputPart,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_head_range,
    split_evenly,
)


@dataclass(frozen=True)
class DeepStackInput:
    rows: torch.Tensor  # [num_visual] int64: batch rows of the scheduled visual tokens
    embeds: torch.Tensor  # [levels, num_visual, hidden]: level i is added after layer i


def rotary_embedding(cfg: DecoderConfig) -> MRotaryEmbedding:
    """The rotary embedding of `cfg` (fp32 frequency buffers; build after any dtype cast)."""
    return MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference.rms_norm(x, self.weight, self.eps)


class MRotaryEmbedding(nn.Module):
    """Rotary embedding over three position rows (t, h, w); each frequency rotates with one row. In blocks
    (Qwen2-VL): the frequencies split into `mrope_section` runs, run i on row i. Interleaved (Qwen3-VL):
    frequency j takes row 1 (h) when j % 3 == 1 and j < 3 * section[1], row 2 (w) when j % 3 == 2 and
    j < 3 * section[2], else row 0 (t). Equal rows give plain 1-D RoPE either way."""

    def __init__(
        self, head_dim: int, theta: float, mrope_section: list[int] | None, interleaved: bool = False
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 2]
        section = mrope_section or [head_dim // 2]
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {head_dim // 2}")
        # Which position row drives each frequency: [head_dim / 2]
        if interleaved and len(section) == 3:
            row = torch.zeros(head_dim // 2, dtype=torch.long)
            row[1 : 3 * section[1] : 3] = 1
            row[2 : 3 * section[2] : 3] = 2
        else:
            row = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
        self.register_buffer("row_of_freq", row, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, num_tokens] -> cos, sin: [num_tokens, 1, head_dim]."""
        pos = positions.float().gather(
            0, self.row_of_freq[:, None].expand(-1, positions.shape[1])
        )  # [head_dim/2, T]
        freqs = pos.t() * self.inv_freq  # [T, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    """This rank's query heads and the KV heads they read (all of them with one rank)."""

    def __init__(self, cfg: DecoderConfig, backend: AttentionBackend, tp: TensorParallelGroup) -> None:
        super().__init__()
        hd = cfg.head_dim
        first_kv, self.num_kv_heads = kv_head_range(cfg.num_heads, cfg.num_kv_heads, tp.rank, tp.world_size)
        self.num_heads, self.head_dim = cfg.num_heads // tp.world_size, hd
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        kv = OutputPart(cfg.num_kv_heads * hd, first_kv * hd, self.kv_size)
        q = OutputPart(cfg.num_heads * hd, tp.rank * self.q_size, self.q_size)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q, kv, kv], bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * hd, cfg.hidden_size, bias=False, tp=tp)
        # Qwen3: RMSNorm over each head's dims on q and k, before RoPE.
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.backend = backend
        # [2, this rank's KV heads] fp32: K and V scales of an FP8 KV cache (ones unless the checkpoint has
        # calibrated ones); kept fp32 whatever dtype the module is cast to (see _apply).
        self.first_kv_head, self.num_kv_heads_total = first_kv, cfg.num_kv_heads
        self.register_buffer("kv_scales", torch.ones(2, self.num_kv_heads), persistent=False)
        self.calibrate_kv_scales = False  # set: the next forward over an FP8 cache sets kv_scales from its K/V
        self.elementwise = TORCH_ELEMENTWISE  # Decoder.set_elementwise_ops

    def _apply(self, fn: object, recurse: bool = True) -> Attention:
        """nn.Module.to & co. move the scales but never lower their precision: they stay fp32."""
        super()._apply(fn, recurse)  # type: ignore[arg-type]
        self.kv_scales = self.kv_scales.float()
        return self

    def load_kv_scale(self, name: str, values: torch.Tensor) -> None:
        """A checkpoint's KV cache scale, `name` "k_scale" | "v_scale": one for all heads (shape () or (1,)) or
        one per KV head of the whole model, of which this rank keeps its own. Must be finite and > 0."""
        row = {"k_scale": 0, "v_scale": 1}.get(name)
        if row is None:
            raise ValueError(f"{name}: an attention layer's scales are k_scale and v_scale")
        if values.dim() > 1 or values.numel() not in (1, self.num_kv_heads_total):
            raise ValueError(
                f"{name}: shape {tuple(values.shape)} is neither one scale nor one per KV head ({self.num_kv_heads_total})"
            )
        values = values.reshape(-1).float()
        if not (values.isfinite().all() and (values > 0).all()):
            raise ValueError(f"{name}: scales must be finite and > 0")
        if values.numel() > 1:
            values = values[self.first_kv_head : self.first_kv_head + self.num_kv_heads]
        with torch.no_grad():
            self.kv_scales[row].copy_(values.expand(self.num_kv_heads))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size], possibly a column-major view
        q_norm, k_norm = self.q_norm, self.k_norm
        norms = (None, None, 0.0) if q_norm is None or k_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        # [num_tokens, heads, head_dim] each
        q, k = self.elementwise.rotary_qk(qkv, cos, sin, self.num_heads, self.num_kv_heads, *norms)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.calibrate_kv_scales and fp8.is_fp8(kv_cache.dtype):
            self.kv_scales.copy_(fp8.calibrated_scales(k, v, kv_cache.dtype))
            self.calibrate_kv_scales = False
        self.backend.store_kv_cache(k, v, kv_cache, batch.slot_mapping, self.kv_scales)
        out = self.backend.paged_attention(
            q, kv_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, self.scale, self.kv_scales,
            batch.attention_metadata,
        )  # fmt: skip
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        half = split_evenly(intermediate_size, tp.rank, tp.world_size, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [half, half], bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, tp=tp)
        self.elementwise = TORCH_ELEMENTWISE  # Decoder.set_elementwise_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.elementwise.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: DecoderConfig,
        backend: AttentionBackend,
        tp: TensorParallelGroup,
        fused_moe: FusedMoE | None = None,  # set: this layer's MLP is the sparse block
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            MLP(cfg.hidden_size, cfg.intermediate_size, tp) if fused_moe is None else SparseMoE(cfg, tp, fused_moe)
        )
        self.elementwise = TORCH_ELEMENTWISE  # Decoder.set_elementwise_ops

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden state entering the layer is x + residual (x alone when residual is None); returns the
        (MLP output, residual) whose sum leaves it. The sums are taken by the norms that follow them (one
        fused step), with transformers' rounding: residual + sublayer output, in the model's dtype."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        normed, residual = self.elementwise.add_rms_norm(x, residual, norm1.weight, norm1.eps)
        attn_out = self.self_attn(normed, cos, sin, batch, kv_cache)
        normed, residual = self.elementwise.add_rms_norm(attn_out, residual, norm2.weight, norm2.eps)
        return self.mlp(normed), residual


class Decoder(nn.Module):
    """One tensor-parallel rank's shard of the decoder (the whole decoder with a group of one).
    `fused_moe`: the expert kernel the sparse layers call (needed when the config has MoE layers)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        backend: AttentionBackend,
        tp: TensorParallelGroup | None = None,
        fused_moe: FusedMoE | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TensorParallelGroup.single()
        self.cfg = cfg
        if cfg.moe_layers and fused_moe is None:
            raise ValueError("this decoder has MoE layers: it needs a fused_moe kernel")
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        moe_layers = set(cfg.moe_layers)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, tp, fused_moe if i in moe_layers else None) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary_embedding(cfg)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.elementwise = TORCH_ELEMENTWISE  # set_elementwise_ops
        self._linear_paths = BLAS_PATHS  # set_linear_paths (not `linear_paths`: that attribute marks the linear layers)
        self.tp_size = tp.world_size
        self.decode_stack: DecodeStack | None = None  # enable_decode_stack

    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: list[torch.Tensor],
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]; media embeddings spliced in
        deepstack: DeepStackInput | None = None,
    ) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, hidden]. `deepstack`: vision features added to
        the visual tokens' hidden states after each of the first layers (Qwen3-VL), as transformers'
        `_deepstack_process` does; a chunk adds the rows of the visual tokens it holds."""
        x = self.embed_tokens(batch.input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary(batch.positions, x.dtype)
        stack, rows = self.decode_stack, batch.num_tokens
        if (
            stack is not None
            and deepstack is None
            and self._linear_paths.path(rows) == "c"
            and stack.takes(rows, batch.attention_metadata)
        ):  # decode rows alone, every product on the C kernel: the whole stack in one C call, same results
            return stack.forward(x, cos, sin, batch.slot_mapping, batch.attention_metadata, kv_caches)  # type: ignore[arg-type]
        residual: torch.Tensor | None = None  # the hidden state is x + residual (x alone while None)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, cos, sin, batch, kv_cache)
            if deepstack is not None and i < deepstack.embeds.shape[0]:
                x, residual = (residual + x).index_add(0, deepstack.rows, deepstack.embeds[i]), None
        return self.elementwise.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def linear_weights(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight [out, in], bias or None) of every dense linear product of a forward, in order: what the
        CPU's linear paths are measured over (`kernels/cpu_linear.py`). The layers that take the paths are
        those with a `linear_paths` attribute (Linear's kinds, QuantizedLinear); quantized ones without a
        dense weight are left out."""
        return [
            (m.weight, m.bias)
            for m in self.modules()
            if hasattr(m, "linear_paths") and isinstance(m.weight, torch.Tensor)
        ]

    def set_linear_paths(self, paths: LinearPaths) -> None:
        """Every linear layer's products from now on take `paths`."""
        self._linear_paths = paths
        for m in self.modules():
            if hasattr(m, "linear_paths"):  # Linear and its parallel kinds, QuantizedLinear
                m.linear_paths = paths

    def _apply(self, fn: object, recurse: bool = True) -> Decoder:
        """nn.Module.to & co. may move the weights: the decode stack holds them as they were, so it goes (enable
        it again after)."""
        self.decode_stack = None
        return super()._apply(fn, recurse)  # type: ignore[arg-type]

    def set_elementwise_ops(self, ops: ElementwiseOps) -> None:
        """Every layer's elementwise steps from now on take `ops` (the decode stack, built on the C ones, goes)."""
        self.decode_stack = None
        for m in self.modules():
            if hasattr(m, "elementwise"):  # Decoder, DecoderLayer, Attention, MLP
                m.elementwise = ops

    def enable_decode_stack(self, kv_cache_dtype: torch.dtype) -> str | None:
        """From now on, a step of decode rows alone whose row count takes the C linear kernel runs the layers and
        the final norm as one C call (`kernels/cpu_decoder.py`: the same kernels, so the same results, without
        the per-layer Python). Call after the weights' cast and `set_elementwise_ops`; returns why it cannot
        (the step then stays composed), or None."""
        if not len(self.layers):
            return "no layers"
        blockers = [
            (self.cfg.moe_layers, "MoE layers"),
            (self.tp_size > 1, "tensor parallelism"),
            (self.elementwise.name != "cpu", f"the {self.elementwise.name} elementwise ops (the C ones only)"),
            (any(layer.self_attn.backend.name != "cpu" for layer in self.layers), "an attention backend but cpu"),
            (kv_cache_dtype != self.embed_tokens.weight.dtype, f"a {kv_cache_dtype} KV cache (the model's dtype only)"),
            (any(not _dense(layer) for layer in self.layers), "quantized or sparse linear layers"),
        ]
        reasons = [reason for blocked, reason in blockers if blocked]
        if reasons:
            return "; ".join(reasons)
        first, layers = self.layers[0].self_attn, [_layer_weights(layer) for layer in self.layers]
        shape = DecoderShape(self.cfg.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim,
                             layers[0].down.shape[1], self.norm.eps)  # fmt: skip
        stack = DecodeStack.create(layers, self.norm.weight, shape)
        if isinstance(stack, str):
            return stack
        self.decode_stack = stack
        return None

    def reset_kv_scales(self) -> None:
        """Every layer's FP8 KV cache scales to 1.0 (after `to_empty`, before a checkpoint sets its own)."""
        for layer in self.layers:
            layer.self_attn.kv_scales.fill_(1.0)

    def calibrate_kv_scales(self) -> None:
        """Each layer sets its FP8 KV cache scales from the K/V of the first forward after this (vLLM's
        `calculate_kv_scales`), replacing the checkpoint's or the default ones; fixed from then on."""
        for layer in self.layers:
            layer.self_attn.calibrate_kv_scales = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [num_rows, hidden] -> fp32 logits [num_rows, vocab] on the first rank, None on the others."""
        return self.lm_head.logits(hidden)


def _dense(layer: DecoderLayer) -> bool:
    """Whether every linear product of the layer is a plain dense one (the kinds in models/parallel.py)."""
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, MLP):
        return False
    expected = ((attn.qkv_proj, ColumnParallelLinear), (attn.o_proj, RowParallelLinear),
                (mlp.gate_up_proj, ColumnParallelLinear), (mlp.down_proj, RowParallelLinear))  # fmt: skip
    return all(type(module) is kind for module, kind in expected)


def _layer_weights(layer: DecoderLayer) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    assert isinstance(mlp, MLP)
    norms = (None, None) if attn.q_norm is None or attn.k_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
    return LayerWeights(layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, *norms,
                        attn.o_proj.weight, layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
                        mlp.down_proj.weight)  # fmt: skip
