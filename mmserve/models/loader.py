"""Loads a decoder's weights from a Hugging Face checkpoint directory (`*.safetensors`, sharded or
not), accepting both key layouts: transformers 5.x (`model.language_model.*`) and the older hub one
(`model.*`). Vision tower keys are left to the encoder loader."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from mmserve.models.qwen2 import Qwen2Decoder

# Checkpoint name (after prefix normalisation) -> (our parameter, shard index) for fused projections.
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_VISION = re.compile(r"^(model\.)?visual\.")


def _normalise_key(key: str) -> str | None:
    """Map a checkpoint key to this decoder's naming, or None for keys it does not own."""
    if _VISION.match(key):
        return None
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    if key.startswith(("lm_head.", "language_model.lm_head.")):
        return key.removeprefix("language_model.")
    return None


def load_decoder_weights(model: Qwen2Decoder, model_dir: str | Path) -> None:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = _normalise_key(key)
                if name is None or name.endswith("rotary_emb.inv_freq"):
                    continue
                if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                    continue  # some tied checkpoints store the shared matrix twice
                tensor = f.get_tensor(key)
                target, shard = name, None
                parts = name.split(".")
                if len(parts) >= 2 and parts[-2] in _FUSED:
                    fused, shard = _FUSED[parts[-2]]
                    target = ".".join([*parts[:-2], fused, parts[-1]])
                if target not in params:
                    raise KeyError(f"checkpoint key {key!r} has no place in the decoder (as {target!r})")
                _copy_into(model, params[target], tensor, name, shard)
                loaded.add(target if shard is None else f"{target}#{shard}")
    _check_complete(model, params, loaded)


def _copy_into(
    model: Qwen2Decoder, param: torch.Tensor, tensor: torch.Tensor, name: str, shard: int | None
) -> None:
    with torch.no_grad():
        if shard is None:
            if param.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}"
                )
            param.copy_(tensor)
            return
        cfg = model.cfg
        if "qkv_proj" in name or name.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
            sizes = [
                cfg.num_heads * cfg.head_dim,
                cfg.num_kv_heads * cfg.head_dim,
                cfg.num_kv_heads * cfg.head_dim,
            ]
        else:
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        start = sum(sizes[:shard])
        part = param.narrow(0, start, sizes[shard])
        if part.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(part.shape)}"
            )
        part.copy_(tensor)


def _check_complete(model: Qwen2Decoder, params: dict[str, torch.Tensor], loaded: set[str]) -> None:
    missing = []
    for name in params:
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        shards = 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else 0
        if shards:
            missing += [f"{name}#{i}" for i in range(shards) if f"{name}#{i}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(
            f"checkpoint is missing decoder weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
