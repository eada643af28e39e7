"""`DecoderConfig`: the decoder's shape, read from any supported Hugging Face config through
`transformers.AutoConfig` (legacy and current formats, VL models' `text_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen2_vl", "qwen2_5_vl", "llama")


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
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        eos = getattr(hf, "eos_token_id", None)
        if eos is None:
            eos = getattr(text, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        tie = bool(getattr(hf, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
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
                qkv_bias=hf.model_type != "llama" or bool(getattr(text, "attention_bias", False)),
                tie_word_embeddings=tie,
                max_position_embeddings=text.max_position_embeddings,
                eos_token_ids=eos_ids,
            ),
            hf,
        )
