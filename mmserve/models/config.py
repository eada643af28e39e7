"""`DecoderConfig`: the decoder's shape, read from any supported Hugging Face config through
`transformers.AutoConfig` (legacy and current formats, VL models' `text_config`), and its quantization
(`quantization_config`, parsed and validated by `models/quant/scheme.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from mmserve.models.quant.scheme import QuantizationConfig, parse_quantization_config

SUPPORTED_MODEL_TYPES = (
    "qwen2", "qwen2_vl", "qwen2_5_vl", "llama", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe"
)  # fmt: skip
# Families with per-head RMSNorm on q and k (Qwen3), interleaved M-RoPE (Qwen3-VL) and MoE layers.
_QK_NORM = ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe")
_INTERLEAVED_MROPE = ("qwen3_vl", "qwen3_vl_moe")
_MOE = ("qwen3_moe", "qwen3_vl_moe")
_QKV_BIAS = ("qwen2", "qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: list[int] | None  # None: plain 1-D RoPE
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    mrope_interleaved: bool = False  # (t, h, w) frequencies interleaved (Qwen3-VL), not in blocks (Qwen2-VL)
    # Mixture of experts: `moe_layers` lists the layers whose MLP is the sparse block; the others are dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # DeepStack (Qwen3-VL): vision features added to the hidden states after each of the first N layers.
    num_deepstack_levels: int = 0
    # The checkpoint's quantization (None: unquantized weights).
    quantization: QuantizationConfig | None = None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> tuple[DecoderConfig, PretrainedConfig]:
        hf = AutoConfig.from_pretrained(model_dir)
        if hf.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {hf.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        text = hf.get_text_config()
        rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ValueError(f"rope type {rope_type!r} is not supported yet (only default RoPE and M-RoPE)")
        mrope_section = rope.get("mrope_section")
        if hf.model_type in ("qwen2_vl", "qwen2_5_vl") and mrope_section is None:
            mrope_section = [16, 24, 24]  # transformers' default for these models
        if hf.model_type in _INTERLEAVED_MROPE and mrope_section is None:
            mrope_section = [24, 20, 20]  # transformers' default for Qwen3-VL
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        eos = getattr(hf, "eos_token_id", None)
        if eos is None:
            eos = getattr(text, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        # The top-level value rules (transformers ties by it); a VL text config may carry a stale default.
        tie = bool(getattr(hf, "tie_word_embeddings", False))
        moe: dict = {}
        if hf.model_type in _MOE:
            dense = set(getattr(text, "mlp_only_layers", None) or ())
            step = int(getattr(text, "decoder_sparse_step", 1) or 1)
            moe = dict(
                num_experts=text.num_experts,
                num_experts_per_tok=text.num_experts_per_tok,
                moe_intermediate_size=text.moe_intermediate_size,
                # Qwen3-VL-MoE's router always renormalises; Qwen3-MoE's as `norm_topk_prob` says.
                norm_topk_prob=hf.model_type == "qwen3_vl_moe" or bool(getattr(text, "norm_topk_prob", False)),
                moe_layers=tuple(
                    i
                    for i in range(text.num_hidden_layers)
                    if i not in dense and text.num_experts > 0 and (i + 1) % step == 0
                ),
            )
        vision = getattr(hf, "vision_config", None)
        deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or ()) if vision is not None else 0
        return (
            cls(
                model_type=hf.model_type,
                vocab_size=text.vocab_size,
                hidden_size=text.hidden_size,
                intermediate_size=text.intermediate_size,
                num_layers=text.num_hidden_layers,
                num_heads=num_heads,
                num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
                head_dim=head_dim,
                rms_norm_eps=text.rms_norm_eps,
                rope_theta=float(rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))),
                mrope_section=list(mrope_section) if mrope_section else None,
                qkv_bias=hf.model_type in _QKV_BIAS or bool(getattr(text, "attention_bias", False)),
                tie_word_embeddings=tie,
                max_position_embeddings=text.max_position_embeddings,
                eos_token_ids=eos_ids,
                qk_norm=hf.model_type in _QK_NORM,
                mrope_interleaved=hf.model_type in _INTERLEAVED_MROPE,
                num_deepstack_levels=deepstack,
                quantization=parse_quantization_config(
                    getattr(hf, "quantization_config", None) or getattr(text, "quantization_config", None)
                ),
                **moe,
            ),
            hf,
        )
