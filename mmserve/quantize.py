"""Writes quantized copies of a checkpoint (one made by `mmserve make-tiny-model`, or any dense Qwen-family one) in
the layouts the hub's quantized releases use, for tests and benchmarks:

- compressed-tensors (`FORMATS` fp8-tensor, fp8-dynamic, fp8-block, w8a8, w4a16, w4a16-asym): the library's own
  `apply_quantization_config`, weight scales from each weight's min / max (`calculate_qparams`: what
  llm-compressor's min-max observer computes), then its `ModelCompressor` and `update_config`, as llm-compressor
  saves;
- AutoAWQ GEMM (`awq`): the w4a16-asym quantization with fp16 scales, written by hand in AutoAWQ's packing
  (`qweight` [K, N/8] and `qzeros` [K/g, N/8] in its interleaved nibble order, `scales` [K/g, N] fp16);
- Qwen's block-wise FP8 (`qwen-fp8`): the fp8-block weights, each block's scale as `weight_scale_inv`, with
  `quant_method: "fp8"` and `modules_to_not_convert` naming lm_head and every vision layer as Qwen3-VL-FP8 does.

The vision tower and lm_head stay unquantized. `reference_dir` also writes a dense checkpoint whose weights are
compressed-tensors' own dequantization of the quantized ones (the weight-only reference for loaders). Knows
nothing of the engine or of mmserve's loaders."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

CT_FORMATS = ("fp8-tensor", "fp8-dynamic", "fp8-block", "w8a8", "w4a16", "w4a16-asym")
FORMATS = (*CT_FORMATS, "awq", "qwen-fp8")
# AutoAWQ's GEMM packing: nibble j of a word holds output column 8w + AWQ_PACK_ORDER[j] (its `order_map`).
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_VISION = r"re:.*visual.*"
_LAYER_SUFFIX = re.compile(r"(layers\.\d+\..+)$")


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str, *, group_size: int = 128,
                        reference_dir: str | Path | None = None, quantize_vision: bool = False,
                        fp16_scales: bool | None = None) -> Path:  # fmt: skip
    """Write `src` quantized as `fmt` to `dst` and return it. `group_size`: the int4 formats' group (w4a16,
    w4a16-asym, awq). `reference_dir`: also write the dense dequantized twin there. `quantize_vision`: quantize the
    vision tower's linear layers too (compressed-tensors formats; a checkpoint mmserve must refuse).
    `fp16_scales`: round the weight scales to fp16-representable values (AWQ stores fp16; default: for awq only)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if quantize_vision and fmt not in CT_FORMATS:
        raise ValueError("quantize_vision applies to the compressed-tensors formats only")
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    model = _load_dense(src)
    scheme_fmt = {"awq": "w4a16-asym", "qwen-fp8": "fp8-block"}.get(fmt, fmt)
    _apply_scheme(model, scheme_fmt, group_size, quantize_vision)
    fp16 = fmt == "awq" if fp16_scales is None else fp16_scales
    if fmt == "awq" and not fp16:
        raise ValueError("AWQ stores its scales in fp16")
    _calibrate_weights(model, scale_dtype=torch.float16 if fp16 else None)
    if reference_dir is not None:
        _write_reference(src, model, Path(reference_dir))
    if fmt == "awq":
        _write_awq(src, model, dst, group_size)
    else:
        _write_compressed_tensors(src, model, dst)
        if fmt == "qwen-fp8":
            _convert_to_qwen_fp8(dst, model)
    return dst


# ------------------------------------------------------------------------------------ compressed-tensors side


def _load_dense(src: Path) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(src)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    return auto.from_pretrained(src, dtype=torch.float32).eval()


def _ct_scheme(fmt: str, group_size: int) -> dict:
    """compressed-tensors scheme arguments of `fmt` (its presets; fp8-tensor: per-tensor fp8 weights with FP8_DYNAMIC's
    per-token activations)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization import quant_scheme as presets

    preset = {
        "fp8-dynamic": presets.FP8_DYNAMIC, "fp8-block": presets.FP8_BLOCK, "w8a8": presets.INT8_W8A8,
        "w4a16": presets.W4A16, "w4a16-asym": presets.W4A16_ASYM,
    }  # fmt: skip
    if fmt == "fp8-tensor":
        weights = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
        return {"weights": weights, "input_activations": presets.FP8_DYNAMIC["input_activations"]}
    scheme = {k: v.model_copy() for k, v in preset[fmt].items()}
    if fmt.startswith("w4a16"):
        scheme["weights"] = scheme["weights"].model_copy(update={"group_size": group_size})
    return scheme


def _apply_scheme(model: nn.Module, fmt: str, group_size: int, quantize_vision: bool) -> None:
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    scheme = QuantizationScheme(targets=["Linear"], **_ct_scheme(fmt, group_size))
    ignore = ["lm_head"] + ([] if quantize_vision else [_VISION])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore),
                              show_progress=False)  # fmt: skip


def _quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}


def _calibrate_weights(model: nn.Module, scale_dtype: torch.dtype | None) -> None:
    """Each quantized layer's weight scale (and zero point) from its min / max per tensor, row, group or block;
    `scale_dtype`: round the scales to it (fp16 for AWQ, which stores them so)."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    for module in _quantized_modules(model).values():
        args = module.quantization_scheme.weights
        low, high = _min_max(module.weight.detach(), args)
        scale, zero_point = calculate_qparams(low, high, args)
        if scale_dtype is not None:
            scale = scale.to(scale_dtype).float()
        with torch.no_grad():
            module.weight_scale.data = scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype)
            if hasattr(module, "weight_zero_point"):
                zp = zero_point.reshape(module.weight_zero_point.shape)
                module.weight_zero_point.data = zp.to(module.weight_zero_point.dtype)
        module.quantization_status = QuantizationStatus.FROZEN


def _min_max(weight: torch.Tensor, args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (min, max) per the strategy's scale: [1], [N, 1], [N, K / g] or [N / bh, K / bw]."""
    strategy = str(args.strategy)  # type: ignore[attr-defined]
    if strategy == "tensor":
        return weight.min().reshape(1), weight.max().reshape(1)
    if strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    if strategy == "group":
        groups = weight.unflatten(-1, (-1, args.group_size))  # type: ignore[attr-defined]
        return groups.amin(-1), groups.amax(-1)
    if strategy == "block":
        bh, bw = args.block_structure  # type: ignore[attr-defined]
        n, k = weight.shape
        padded = torch.nn.functional.pad(weight, (0, -k % bw, 0, -n % bh))  # zeros: min <= 0 <= max anyway
        blocks = padded.view(padded.shape[0] // bh, bh, padded.shape[1] // bw, bw)
        return blocks.amin((1, 3)), blocks.amax((1, 3))
    raise ValueError(f"no weight observer for strategy {strategy!r}")


def _write_compressed_tensors(src: Path, model: nn.Module, dst: Path) -> None:
    from compressed_tensors.compressors import ModelCompressor

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    _copy_other_files(src, dst)


def _write_reference(src: Path, model: nn.Module, out: Path) -> None:
    """The dense checkpoint whose quantized layers' weights are compressed-tensors' own quantize-dequantize of them."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    out.mkdir(parents=True, exist_ok=True)
    tensors = _dense_tensors(src)
    disk = _disk_keys(tensors)
    for name, module in _quantized_modules(model).items():
        zero_point = getattr(module, "weight_zero_point", None)
        with torch.no_grad():
            value = fake_quantize(module.weight, module.weight_scale, zero_point, module.quantization_scheme.weights)
        tensors[disk[_suffix(name)]] = value.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _copy_other_files(src, out, with_config=True)


# --------------------------------------------------------------------------------------- hand-written formats


def _write_awq(src: Path, model: nn.Module, dst: Path, group_size: int) -> None:
    """AutoAWQ GEMM tensors from the asymmetric int4 quantization (scales already fp16-representable)."""
    from compressed_tensors.quantization.lifecycle.forward import quantize

    tensors = _dense_tensors(src)
    disk = _disk_keys(tensors)
    modules = _quantized_modules(model)
    for name, module in modules.items():
        args = module.quantization_scheme.weights
        codes = quantize(module.weight, module.weight_scale, module.weight_zero_point, args, dtype=torch.int8)
        unsigned = codes.to(torch.int32) + 8  # [N, K] 0..15
        zeros = module.weight_zero_point.to(torch.int32) + 8  # [N, K / g] 0..15
        prefix = disk[_suffix(name)].removesuffix(".weight")
        del tensors[f"{prefix}.weight"]
        tensors[f"{prefix}.qweight"] = awq_pack(unsigned.t())  # [K, N / 8]
        tensors[f"{prefix}.qzeros"] = awq_pack(zeros.t())  # [K / g, N / 8]
        tensors[f"{prefix}.scales"] = module.weight_scale.detach().t().to(torch.float16).contiguous()  # [K / g, N]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _copy_other_files(src, dst, with_config=True)
    quant = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
             "modules_to_not_convert": ["visual"]}  # fmt: skip
    _set_quantization_config(dst, quant)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[R, C] integers 0..15 -> int32 [R, C / 8] as AutoAWQ's GEMM `pack` writes them: for each word w and nibble
    i, column 8w + AWQ_PACK_ORDER[i] shifted left by 4i."""
    r, c = values.shape
    words = torch.zeros(r, c // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_PACK_ORDER):
        words |= values[:, column::8].to(torch.int64) << (4 * i)
    return words.to(torch.int32)  # the low 32 bits, as AutoAWQ's int32 buffer holds them


def _convert_to_qwen_fp8(dst: Path, model: nn.Module) -> None:
    """A compressed-tensors fp8-block checkpoint -> Qwen's FP8 layout: `weight_scale` renamed `weight_scale_inv`,
    `quant_method: "fp8"` (the same codes and block scales)."""
    files = sorted(dst.glob("*.safetensors"))
    for file in files:
        tensors = load_file(str(file))
        renamed = {re.sub(r"\.weight_scale$", ".weight_scale_inv", k): v for k, v in tensors.items()}
        save_file(renamed, str(file), metadata={"format": "pt"})
    vision = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and "visual" in name]
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "modules_to_not_convert": ["lm_head", *vision]}  # fmt: skip
    _set_quantization_config(dst, quant)


# ------------------------------------------------------------------------------------------------------ files


def _dense_tensors(src: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _suffix(name: str) -> str:
    """`...layers.3.mlp.down_proj(.weight)` -> `layers.3.mlp.down_proj`: a decoder layer's name in any key layout."""
    match = _LAYER_SUFFIX.search(name.removesuffix(".weight"))
    if match is None:
        raise ValueError(f"{name} is not a decoder layer's projection")
    return match.group(1)


def _disk_keys(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Decoder layer suffix -> the checkpoint's key of its weight (the on-disk key layout may differ from the
    model's module names)."""
    return {_suffix(k): k for k in tensors if k.endswith(".weight") and _LAYER_SUFFIX.search(k) and "visual" not in k}


def _copy_other_files(src: Path, dst: Path, with_config: bool = False) -> None:
    """Tokenizer, templates, preprocessor and generation configs (config.json too if `with_config`)."""
    for file in src.iterdir():
        if file.suffix == ".safetensors" or file.name.endswith(".safetensors.index.json") or file.is_dir():
            continue
        if (file.name == "config.json" and not with_config) or (dst / file.name).exists():
            continue
        shutil.copy(file, dst / file.name)


def _set_quantization_config(model_dir: Path, quant: dict) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quant
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmserve.quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path, help="dense checkpoint directory")
    p.add_argument("dst", type=Path, help="where the quantized checkpoint goes")
    p.add_argument("--format", choices=FORMATS, required=True)
    p.add_argument("--group-size", type=int, default=128, help="int4 formats' group size")
    p.add_argument("--reference-dir", type=Path, default=None, help="also write the dense dequantized twin here")
    args = p.parse_args(argv)
    out = quantize_checkpoint(args.src, args.dst, args.format, group_size=args.group_size,
                              reference_dir=args.reference_dir)  # fmt: skip
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
