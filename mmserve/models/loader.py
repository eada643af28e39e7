"""Loads a decoder's weights (one tensor-parallel rank's slices of them) from a Hugging Face checkpoint
directory (`*.safetensors`, sharded or not), accepting both key layouts: transformers 5.x
(`model.language_model.*`) and the older hub one (`model.*`), with q/k/v and gate/up stored apart or
already fused, and MoE experts per expert or fused (`models/moe.py`). Each layer says which slice it holds
(`models/parallel.py`); only those bytes are read. Vision tower keys are left to the encoder loader."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mmserve.models.decoder import Decoder
from mmserve.models.moe import Experts

# Checkpoint name (after prefix normalisation) -> (our module, part index) for fused projections.
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_NUM_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}
_VISION = re.compile(r"^(model\.)?visual\.")
# One expert's projection in a per-expert checkpoint: layers.N.mlp.experts.E.gate_proj.weight
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


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


def _slice_reader(tensor_slice: object) -> object:
    """(dim, start, length) -> that slice of a safetensors tensor, reading only its bytes."""

    def read(dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return tensor_slice[index]  # type: ignore[index]

    return read


def load_decoder_weights(model: Decoder, model_dir: str | Path) -> None:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    modules = dict(model.named_modules())
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
                expert = _EXPERT.match(name)
                if expert is not None:  # one expert's projection: the experts module places it
                    experts = modules.get(expert.group(1))
                    if not isinstance(experts, Experts):
                        raise KeyError(f"checkpoint key {key!r} has no place in the decoder (no experts here)")
                    tensor_slice = f.get_slice(key)
                    shape = tuple(tensor_slice.get_shape())
                    _load(experts, expert.group(3), shape, _slice_reader(tensor_slice), int(expert.group(2)), key)
                    continue
                module_name, _, param_name = name.rpartition(".")
                part = None
                *parents, leaf = module_name.split(".")
                if leaf in _FUSED:
                    leaf, part = _FUSED[leaf]
                    module_name = ".".join([*parents, leaf])
                module = modules.get(module_name)
                target = f"{module_name}.{param_name}"
                if module is None or target not in params:
                    raise KeyError(f"checkpoint key {key!r} has no place in the decoder (as {target!r})")
                tensor_slice = f.get_slice(key)
                shape = tuple(tensor_slice.get_shape())
                _load(module, param_name, shape, _slice_reader(tensor_slice), part, key)
                if part is None and leaf in _NUM_PARTS:  # a fused tensor fills every part at once
                    loaded.update(f"{target}#{i}" for i in range(_NUM_PARTS[leaf]))
                else:
                    loaded.add(target if part is None else f"{target}#{part}")
    _check_complete(model, params, loaded)


def _load(module: nn.Module, param_name: str, shape: tuple[int, ...], read: object, part: int | None,
          key: str) -> None:  # fmt: skip
    load_weight = getattr(module, "load_weight", None)
    if load_weight is None:  # a plain module (norms): replicated, loaded whole
        param = getattr(module, param_name)
        if tuple(param.shape) != shape:
            raise ValueError(f"{key}: checkpoint shape {shape} != model shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(read(0, 0, shape[0]))  # type: ignore[operator]
        return
    try:
        load_weight(param_name, shape, read, part)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None


def _check_complete(model: Decoder, params: dict[str, torch.Tensor], loaded: set[str]) -> None:
    missing = []
    for module_name, module in model.named_modules():
        if isinstance(module, Experts):  # tracks its experts itself: per-expert and fused keys both fill it
            missing += [f"{module_name}.{m}" for m in module.missing()]
    for name in params:
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        if ".experts." in name:
            continue
        module = name.rpartition(".")[0].rpartition(".")[2]
        parts = _NUM_PARTS.get(module, 0)
        if parts:
            missing += [f"{name}#{i}" for i in range(parts) if f"{name}#{i}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(
            f"checkpoint is missing decoder weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
