"""Loads a decoder's weights (one tensor-parallel rank's slices of them) from a Hugging Face checkpoint
directory (`*.safetensors`, sharded or not), accepting both key layouts: transformers 5.x
(`model.language_model.*`) and the older hub one (`model.*`), with q/k/v and gate/up stored apart or
already fused, and MoE experts per expert or fused (`models/moe.py`). Each layer says which slice it holds
(`models/parallel.py`); only those bytes are read. Vision tower keys are left to the encoder loader.

Quantized checkpoints (`models/quant/`): the layers a checkpoint stores quantized (found from its tensor names,
each given its scheme by `quantization_config`) are swapped for `QuantizedLinear` before any weight is allocated,
load their tensors themselves, and are converted to their compute path once everything is read. Optional FP8
KV-cache scales (`self_attn.k_scale` / `v_scale`) go to the attention module (`load_kv_scale`)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mmserve.distributed.group import TensorParallelGroup
from mmserve.kernels.dispatch import AttentionBackend
from mmserve.kernels.quant import w4a16_linear
from mmserve.models.config import DecoderConfig
from mmserve.models.decoder import Decoder
from mmserve.models.moe import Experts, FusedMoE
from mmserve.models.quant.formats import WHOLE
from mmserve.models.quant.linear import CPU, QuantizedLinear, W4A16Linear, replace_with_quantized
from mmserve.models.quant.scheme import LinearScheme

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
# Tensors only a quantized linear layer stores (beside `weight`, `bias`), in every supported layout.
QUANT_TENSORS = frozenset({
    "weight_scale", "weight_zero_point", "weight_packed", "weight_shape", "weight_g_idx", "weight_global_scale",
    "weight_scale_inv", "input_scale", "input_zero_point", "qweight", "qzeros", "scales", "g_idx",
})  # fmt: skip
# FP8 KV-cache scales, handed to `layers.N.self_attn.load_kv_scale` (optional: absent ones stay 1.0).
_KV_SCALE = re.compile(r"^layers\.\d+\.self_attn\.(k_scale|v_scale)$")
# Checkpoint dtypes (safetensors names) a plain floating-point parameter may be loaded from.
_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


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


def _slice_reader(f: object, key: str) -> object:
    """(dim, start, length) -> that slice of checkpoint tensor `key`, reading only its bytes; dim WHOLE: all of it."""
    tensor_slice = f.get_slice(key)  # type: ignore[attr-defined]

    def read(dim: int, start: int, length: int) -> torch.Tensor:
        if dim == WHOLE:
            return f.get_tensor(key)  # type: ignore[attr-defined]
        index = (slice(None),) * dim + (slice(start, start + length),)
        return tensor_slice[index]

    return read


def _float_reader(read: object, key: str, dtype: str) -> object:
    """`read`, refusing a checkpoint tensor that is not plain floating point (quantized codes that no scheme
    covers would otherwise be copied as numbers)."""
    if dtype in _FLOAT_DTYPES:
        return read

    def refuse(dim: int, start: int, length: int) -> torch.Tensor:
        raise ValueError(
            f"{key} holds {dtype} values, but no quantization scheme covers it (quantization_config missing or "
            "not naming this layer)"
        )

    return refuse


def load_decoder(model_dir: str | Path, cfg: DecoderConfig, backend: AttentionBackend,
                 tp: TensorParallelGroup | None = None, fused_moe: FusedMoE | None = None,
                 quant_compute: str | None = None, w4a16_linear: W4A16Linear = w4a16_linear,
                 device: torch.device = CPU) -> Decoder:  # fmt: skip
    """This rank's decoder with its weights loaded, on the CPU in the checkpoint's precision (fp32 for quantized
    layers' dequantized weights; their codes and scales as they are); the caller casts and moves it to `device`.
    `quant_compute`: the quantized layers' compute path, "auto" | "dequantized" | "native" (None:
    $MMSERVE_QUANT_COMPUTE, else auto for `device`; see models/quant/linear.py); `w4a16_linear` the int4 layers'
    native kernel."""
    with torch.device("meta"):
        model = Decoder(cfg, backend, tp, fused_moe)
        if cfg.quantization is not None:
            layers = quantized_layers(model_dir, cfg)
            replace_with_quantized(model, layers, quant_compute, w4a16_linear, device)
    model = model.to_empty(device="cpu")
    model.reset_kv_scales()  # to_empty left them uninitialised; the checkpoint may then set them
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    load_decoder_weights(model, model_dir)
    return model


def quantized_layers(model_dir: str | Path, cfg: DecoderConfig) -> dict[str, LinearScheme]:
    """Decoder module name (e.g. `layers.0.self_attn.qkv_proj`) -> its scheme, for every layer the checkpoint
    stores quantized. The tensors decide which layers are quantized (a layer `ignore`d by the config is stored in
    full); the config says how. ValueError for a quantized tensor no scheme covers, fused parts quantized
    differently, and quantized layers mmserve does not serve (MoE experts and router, embeddings, lm_head)."""
    quant = cfg.quantization
    if quant is None:
        return {}
    parts: dict[str, dict[int | None, LinearScheme]] = {}
    for key in _checkpoint_keys(model_dir):
        name = _normalise_key(key)
        if name is None:
            continue
        module_name, _, tensor = name.rpartition(".")
        if tensor not in QUANT_TENSORS:
            continue
        checkpoint_module = key.rpartition(".")[0]
        if ".mlp.experts." in module_name or module_name.endswith((".mlp.gate", ".mlp.experts")):
            raise ValueError(f"{key}: quantized MoE experts and routers are not supported")
        if not module_name.startswith("layers."):
            raise ValueError(f"{key}: a quantized {module_name} is not supported (keep it unquantized: `ignore` it)")
        # The config names layers as the quantizing tool's model did, which may be the other key layout's names.
        aliases = [f"{prefix}{module_name}" for prefix in ("model.language_model.", "model.", "language_model.model.")]
        scheme = quant.scheme_for(checkpoint_module, *aliases)
        if scheme is None:
            raise ValueError(
                f"{key}: the checkpoint stores {checkpoint_module} quantized, but its {quant.method} "
                "quantization_config gives that layer no scheme (ignored or not targeted)"
            )
        *parents, leaf = module_name.split(".")
        part = None
        if leaf in _FUSED:
            leaf, part = _FUSED[leaf]
        parts.setdefault(".".join([*parents, leaf]), {})[part] = scheme
    schemes = {}
    for module_name, by_part in parts.items():
        distinct = set(by_part.values())
        if len(distinct) > 1:
            described = sorted(s.describe() for s in distinct)
            raise ValueError(f"the fused parts of {module_name} are quantized differently: {described}")
        schemes[module_name] = distinct.pop()
    return schemes


def _checkpoint_keys(model_dir: str | Path) -> list[str]:
    keys = []
    for file in _safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            keys.extend(f.keys())
    return keys


def _safetensors_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def load_decoder_weights(model: Decoder, model_dir: str | Path) -> None:
    """Fill `model`'s (this rank's) weights from the checkpoint, then convert its quantized layers to their
    compute path. ValueError for a missing, misshapen or unplaced weight."""
    files = _safetensors_files(model_dir)
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
                tensor_slice = f.get_slice(key)
                shape, dtype = tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()
                read = _slice_reader(f, key)
                if _KV_SCALE.match(name):  # optional: the attention module takes them if it has a cache to scale
                    attention = modules.get(name.rpartition(".")[0])
                    if attention is None:
                        raise KeyError(f"checkpoint key {key!r} has no place in the decoder (no such layer)")
                    if hasattr(attention, "load_kv_scale"):
                        try:
                            attention.load_kv_scale(name.rpartition(".")[2], read(WHOLE, 0, 0))
                        except ValueError as exc:
                            raise ValueError(f"{key}: {exc}") from None
                    continue
                expert = _EXPERT.match(name)
                if expert is not None:  # one expert's projection: the experts module places it
                    experts = modules.get(expert.group(1))
                    if not isinstance(experts, Experts):
                        raise KeyError(f"checkpoint key {key!r} has no place in the decoder (no experts here)")
                    read = _float_reader(read, key, dtype)
                    _load(experts, expert.group(3), shape, read, int(expert.group(2)), key)
                    continue
                module_name, _, param_name = name.rpartition(".")
                part = None
                *parents, leaf = module_name.split(".")
                if leaf in _FUSED:
                    leaf, part = _FUSED[leaf]
                    module_name = ".".join([*parents, leaf])
                module = modules.get(module_name)
                if isinstance(module, QuantizedLinear):  # takes its own tensors; `missing()` tracks them
                    _load(module, param_name, shape, read, part, key)
                    continue
                target = f"{module_name}.{param_name}"
                if param_name in QUANT_TENSORS:
                    raise ValueError(
                        f"{key} is a quantized layer's tensor, but no quantization scheme covers {module_name} "
                        "(quantization_config missing or not naming this layer)"
                    )
                if module is None or target not in params:
                    raise KeyError(f"checkpoint key {key!r} has no place in the decoder (as {target!r})")
                _load(module, param_name, shape, _float_reader(read, key, dtype), part, key)
                if part is None and leaf in _NUM_PARTS:  # a fused tensor fills every part at once
                    loaded.update(f"{target}#{i}" for i in range(_NUM_PARTS[leaf]))
                else:
                    loaded.add(target if part is None else f"{target}#{part}")
    _check_complete(model, params, loaded)
    for module_name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            try:
                module.finalize()
            except ValueError as exc:
                raise ValueError(f"{module_name}: {exc}") from None


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
    quantized = set()
    for module_name, module in model.named_modules():
        if isinstance(module, (Experts, QuantizedLinear)):  # track their tensors themselves
            missing += [f"{module_name}.{m}" for m in module.missing()]
        if isinstance(module, QuantizedLinear):
            quantized.add(module_name)
    for name in params:
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        if ".experts." in name or name.rpartition(".")[0] in quantized:
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
