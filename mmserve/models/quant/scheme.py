"""What a checkpoint's `quantization_config` says, parsed once into frozen, validated schemes: compressed-tensors
(read through the library's own `QuantizationConfig`), AutoAWQ's GEMM format, and the block-wise FP8 format of
Qwen's FP8 releases (`quant_method: "fp8"`). Anything mmserve cannot serve is refused here, naming what is not
supported. Knows nothing of tensors, modules or devices."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Layout(StrEnum):
    """How a quantized linear layer's tensors are stored on disk (N output rows, K input columns)."""

    UNPACKED = "unpacked"  # compressed-tensors float/int/naive-quantized: `weight` [N, K] fp8 / int8 codes, `weight_scale`
    PACKED = "packed"  # compressed-tensors pack-quantized: `weight_packed` int32 [N, K/8], `weight_scale`,
    # `weight_zero_point` int32 [N/8, G] (asymmetric only), `weight_shape` [2]
    AWQ = "awq"  # AutoAWQ GEMM: `qweight` int32 [K, N/8], `qzeros` int32 [K/g, N/8] (AWQ's nibble order), `scales` [K/g, N]
    FP8_BLOCK = "fp8_block"  # Qwen / DeepSeek FP8: `weight` fp8 [N, K], `weight_scale_inv` [ceil(N/bh), ceil(K/bw)]


class Codes(StrEnum):
    """The number format of stored weight (or activation) codes."""

    FP8 = "fp8_e4m3"
    INT8 = "int8"
    INT4 = "int4"


class Granularity(StrEnum):
    """Which weights share one scale: the whole tensor, an output row, a row's run of `group_size` columns, or a
    `block_rows` x `group_size` block."""

    TENSOR = "tensor"
    CHANNEL = "channel"
    GROUP = "group"
    BLOCK = "block"


@dataclass(frozen=True)
class WeightScheme:
    codes: Codes
    granularity: Granularity
    group_size: int | None = None  # columns per scale: GROUP's group, BLOCK's block width
    block_rows: int | None = None  # BLOCK's block height
    symmetric: bool = True  # False: a zero point per scale (int4 only)

    def describe(self) -> str:
        if self.granularity is Granularity.BLOCK:
            per = f"per {self.block_rows}x{self.group_size} block"
        elif self.granularity is Granularity.GROUP:
            per = f"per group of {self.group_size}"
        else:
            per = f"per {self.granularity.value}"
        return f"{self.codes.value} weights {per}{'' if self.symmetric else ' with zero points'}"


@dataclass(frozen=True)
class ActivationScheme:
    """Dynamic symmetric quantization of a layer's input, recomputed for every batch."""

    codes: Codes  # FP8 or INT8
    group_size: int | None = None  # None: one scale per token; else one per token and run of columns

    def describe(self) -> str:
        per = "per token" if self.group_size is None else f"per token group of {self.group_size}"
        return f"dynamic {self.codes.value} activations {per}"


@dataclass(frozen=True)
class LinearScheme:
    """How one linear layer is quantized and stored."""

    layout: Layout
    weights: WeightScheme
    activations: ActivationScheme | None = None  # None: activations stay in the compute dtype

    def describe(self) -> str:
        acts = self.activations.describe() if self.activations is not None else "unquantized activations"
        return f"{self.layout.value}: {self.weights.describe()}, {acts}"


@dataclass(frozen=True)
class QuantGroup:
    """Modules a scheme applies to, with compressed-tensors' target semantics: "Linear" is every linear layer,
    "re:PATTERN" a regex matched from the start of the module name, anything else the exact name."""

    targets: tuple[str, ...]
    scheme: LinearScheme


@dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's `quantization_config`, validated. Module names are the checkpoint's own (the tensor key
    without its last component, e.g. `model.language_model.layers.0.self_attn.q_proj`)."""

    method: str  # "compressed-tensors" | "awq" | "fp8"
    groups: tuple[QuantGroup, ...]
    ignore: tuple[str, ...] = ()

    def scheme_for(self, *names: str) -> LinearScheme | None:
        """The scheme the config gives the linear layer known by `names` (its checkpoint name first, then aliases
        such as the other key layout's), or None: ignored under any of them, or targeted by no group."""
        if any(self._ignored(name) for name in names):
            return None
        for group in self.groups:
            if any(_target_matches(t, name) for t in group.targets for name in names):
                return group.scheme
        return None

    def _ignored(self, module: str) -> bool:
        if self.method == "compressed-tensors":  # exact names and "re:" patterns, as compressed-tensors matches
            return any(_target_matches(t, module) for t in self.ignore if t != "Linear")
        # `modules_to_not_convert`: vLLM skips a layer whose name contains an entry, transformers one that an
        # entry matches from the start up to a module boundary (or as a regex, or a suffix); either skips here.
        return any(key in module or _prefix_match(key, module) for key in self.ignore)


def _target_matches(target: str, module: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), module) is not None
    return target == module


def _prefix_match(pattern: str, module: str) -> bool:
    try:
        return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) is not None
    except re.error:  # not a regex: the substring test already ran
        return False


def parse_quantization_config(raw: Any) -> QuantizationConfig | None:
    """`config.json`'s `quantization_config` (a dict, or transformers' config object) -> a validated config, or None
    when the checkpoint is not quantized. Raises ValueError naming what is not supported."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(vars(raw))
    method = str(raw.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    if method == "awq":
        return _parse_awq(raw)
    if method == "fp8":
        return _parse_fp8(raw)
    raise ValueError(
        f"quantization method {method or raw!r} is not supported; mmserve serves compressed-tensors, awq "
        f"(GEMM) and fp8 (block-wise) checkpoints"
    )


# ------------------------------------------------------------------------------------------ compressed-tensors

_CT_UNPACKED_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")


def _parse_compressed_tensors(raw: dict) -> QuantizationConfig:
    from compressed_tensors.quantization import QuantizationConfig as CTConfig
    from compressed_tensors.quantization import QuantizationScheme

    if raw.get("sparsity_config"):
        raise ValueError("compressed-tensors sparsity (sparsity_config) is not supported")
    if raw.get("transform_config"):
        raise ValueError("compressed-tensors transforms (transform_config, e.g. rotations) are not supported")
    ct = CTConfig.model_validate(raw)
    groups = []
    for name, group in ct.config_groups.items():
        if not isinstance(group, QuantizationScheme):  # a bare list of targets: a preset name
            raise ValueError(f"compressed-tensors config group {name!r} is not a full scheme: {group!r}")
        fmt = group.format or ct.format
        try:
            scheme = _ct_scheme(group, fmt)
        except ValueError as exc:
            raise ValueError(f"compressed-tensors config group {name!r}: {exc}") from None
        groups.append(QuantGroup(tuple(group.targets), scheme))
    return QuantizationConfig("compressed-tensors", tuple(groups), tuple(ct.ignore or ()))


def _ct_scheme(group: Any, fmt: str) -> LinearScheme:
    if group.output_activations is not None:
        raise ValueError("output activation quantization is not supported")
    w = group.weights
    if w is None:
        raise ValueError("activation-only quantization (no weight scheme) is not supported")
    if w.dynamic:
        raise ValueError("dynamic weight quantization is not supported")
    if w.actorder == "group":
        raise ValueError("GPTQ activation ordering by group (actorder 'group', a g_idx permutation) is not supported")
    weights = _ct_weights(w)
    if fmt in _CT_UNPACKED_FORMATS:
        if weights.codes is Codes.INT4:
            raise ValueError(f"4-bit weights in format {fmt!r} are not supported (use pack-quantized)")
        if not weights.symmetric:
            raise ValueError(f"asymmetric {weights.codes.value} weights are not supported")
        layout = Layout.UNPACKED
    elif fmt == "pack-quantized":
        if weights.codes is not Codes.INT4:
            raise ValueError(f"pack-quantized {weights.codes.value} weights are not supported (only 4-bit)")
        if weights.granularity not in (Granularity.GROUP, Granularity.CHANNEL):
            raise ValueError(f"pack-quantized weights per {weights.granularity.value} are not supported")
        layout = Layout.PACKED
    else:
        raise ValueError(
            f"compressed-tensors format {fmt!r} is not supported (supported: {', '.join(_CT_UNPACKED_FORMATS)}, "
            "pack-quantized)"
        )
    return LinearScheme(layout, weights, _ct_activations(group.input_activations))


def _ct_weights(w: Any) -> WeightScheme:
    kind = (str(w.type), int(w.num_bits))
    codes = {("float", 8): Codes.FP8, ("int", 8): Codes.INT8, ("int", 4): Codes.INT4}.get(kind)
    if codes is None:
        raise ValueError(f"{kind[1]}-bit {kind[0]} weights are not supported (fp8, int8 and int4 are)")
    strategy = str(w.strategy)
    if strategy == "tensor":
        return WeightScheme(codes, Granularity.TENSOR, symmetric=w.symmetric)
    if strategy == "channel":
        return WeightScheme(codes, Granularity.CHANNEL, symmetric=w.symmetric)
    if strategy == "group":
        return WeightScheme(codes, Granularity.GROUP, group_size=_positive(w.group_size, "group_size"),
                            symmetric=w.symmetric)  # fmt: skip
    if strategy == "block":
        rows, cols = _block(w.block_structure)
        return WeightScheme(codes, Granularity.BLOCK, group_size=cols, block_rows=rows, symmetric=w.symmetric)
    raise ValueError(f"weight strategy {strategy!r} is not supported (tensor, channel, group and block are)")


def _ct_activations(a: Any) -> ActivationScheme | None:
    if a is None:
        return None
    if a.dynamic is not True:
        raise ValueError(
            "static activation scales (input_scale) are not supported; only dynamic activation quantization is"
        )
    if not a.symmetric:
        raise ValueError("asymmetric activation quantization is not supported")
    kind = (str(a.type), int(a.num_bits))
    codes = {("float", 8): Codes.FP8, ("int", 8): Codes.INT8}.get(kind)
    if codes is None:
        raise ValueError(f"{kind[1]}-bit {kind[0]} activations are not supported (fp8 and int8 are)")
    strategy = str(a.strategy)
    if strategy == "token":
        return ActivationScheme(codes)
    if strategy == "group":
        return ActivationScheme(codes, _positive(a.group_size, "activation group_size"))
    raise ValueError(f"dynamic activation strategy {strategy!r} is not supported (token and group are)")


# ------------------------------------------------------------------------------------------------------ AWQ


def _parse_awq(raw: dict) -> QuantizationConfig:
    version = str(raw.get("version", raw.get("format", "gemm"))).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported (only the GEMM layout)")
    bits = int(raw.get("bits", raw.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"AWQ with {bits}-bit weights is not supported (only 4-bit)")
    if not raw.get("zero_point", True):
        raise ValueError("AWQ without zero points is not supported")
    group = int(raw.get("group_size", raw.get("q_group_size", 128)))
    weights = (
        WeightScheme(Codes.INT4, Granularity.CHANNEL, symmetric=False)
        if group == -1
        else WeightScheme(Codes.INT4, Granularity.GROUP, group_size=_positive(group, "group_size"), symmetric=False)
    )
    ignore = tuple(raw.get("modules_to_not_convert") or ())
    return QuantizationConfig("awq", (QuantGroup(("Linear",), LinearScheme(Layout.AWQ, weights)),), ignore)


# ------------------------------------------------------------------------------------------- Qwen's FP8


def _parse_fp8(raw: dict) -> QuantizationConfig:
    fmt = str(raw.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"fp8 format {fmt!r} is not supported (only e4m3)")
    block = raw.get("weight_block_size")
    if block is None:
        raise ValueError("fp8 checkpoints without weight_block_size (per-tensor fp8) are not supported")
    rows, cols = _block(block)
    activation = str(raw.get("activation_scheme", "dynamic")).lower()
    if activation != "dynamic":
        raise ValueError(f"fp8 activation_scheme {activation!r} is not supported (only dynamic)")
    # vLLM's block-wise FP8 quantizes activations per token and group of one block's width.
    scheme = LinearScheme(
        Layout.FP8_BLOCK,
        WeightScheme(Codes.FP8, Granularity.BLOCK, group_size=cols, block_rows=rows),
        ActivationScheme(Codes.FP8, cols),
    )
    ignore = tuple(raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ())
    return QuantizationConfig("fp8", (QuantGroup(("Linear",), scheme),), ignore)


def _block(block: Any) -> tuple[int, int]:
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        raise ValueError(f"block structure must be [rows, columns], got {block!r}")
    return _positive(block[0], "block rows"), _positive(block[1], "block columns")


def _positive(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value
