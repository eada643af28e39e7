"""Quantized checkpoints through the real engine: each format `mmserve.quantize` writes (compressed-tensors fp8 per
tensor / channel / block, int8 W8A8, packed int4 symmetric / asymmetric / any group; AutoAWQ GEMM; Qwen's
block-wise FP8) loads through `mmserve.LLM` on both compute paths and matches a reference:

- weight-only formats (int4): greedy tokens identical and chosen-token logprobs within 1e-4 of transformers' own
  loading of the checkpoint (compressed-tensors), or of the dense checkpoint holding compressed-tensors'
  dequantization of the same weights where transformers cannot load it on the CPU (asymmetric packed zero points,
  AWQ without gptqmodel);
- formats that also quantize activations (fp8, W8A8): an implementation's float rounding a hair apart from the
  reference moves a few activation codes by one step, which moves the next layer's inputs by a fraction of a step
  and cascades (measured: ~1% of the hidden state after one layer). So they are compared teacher-forced (each
  position's prompt is the reference's own prefix): mean |logprob difference| <= 0.05, max <= 0.3, and the same
  greedy token wherever the reference's top two are more than 0.3 apart.

Also: memory held per path (exact bytes), tensor-parallel shards (in process, and one two-rank engine), and the
errors for unsupported schemes, misshapen tensors, splits off a group boundary, a quantized vision tower.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmserve import LLM, SamplingParams
from mmserve.config import EngineArgs
from mmserve.distributed.group import TensorParallelGroup
from mmserve.engine.core import _approx_weight_bytes
from mmserve.errors import InvalidRequestError
from mmserve.kernels.dispatch import AttentionBackend
from mmserve.models.config import DecoderConfig
from mmserve.models.loader import load_decoder
from mmserve.models.quant import linear as quant_linear
from mmserve.models.quant.formats import Span, read_local, to_canonical
from mmserve.models.quant.linear import QUANT_COMPUTE_ENV, ComputePath, QuantizedLinear, resolve_compute_path
from mmserve.models.quant.scheme import parse_quantization_config
from mmserve.quantize import quantize_checkpoint
from mmserve.tiny_model import make_tiny_model
from tests.test_mm_parity import IMG_SMALL, user

NUM_NEW_TOKENS = 6
PROMPT_LENGTHS = (3, 20, 64, 130)
PATHS = ("dequantized", "native")
# Widths that hold whole 128-column groups and blocks (the tiny preset's 64 do not); head_dim 128 on Qwen3.
SHAPES = {"hidden": 256, "intermediate": 512, "init_std": 0.08}
WEIGHT_ONLY_ATOL = 1e-4
ACT_MEAN, ACT_MAX = 0.05, 0.3  # teacher-forced |logprob difference| bounds of activation-quantized formats


def _prompts(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4000) for _ in range(n)] for n in PROMPT_LENGTHS]  # plain BPE ids, no specials


@contextmanager
def _compute_path(path: str) -> Iterator[None]:
    old = os.environ.get(QUANT_COMPUTE_ENV)
    os.environ[QUANT_COMPUTE_ENV] = path
    try:
        yield
    finally:
        if old is None:
            del os.environ[QUANT_COMPUTE_ENV]
        else:
            os.environ[QUANT_COMPUTE_ENV] = old


def _llm(model_dir: Path, path: str, **settings: object) -> LLM:
    # 4096 tokens: every test's batch at once
    return LLM(model_dir, **{"num_kv_blocks": 256, "quant_compute": path, **settings})


_MAX_OPEN_ENGINES = 6


@pytest.fixture(scope="module")
def engine() -> Iterator[Callable[[Path, str], LLM]]:
    """(checkpoint, compute path) -> one engine per pair, shared by the tests (engine start-up is most of
    their time); the least recently used is closed beyond a few, the rest after the module."""
    made: dict[tuple[Path, str], LLM] = {}

    def get(model_dir: Path, path: str) -> LLM:
        llm = made.pop((model_dir, path), None) or _llm(model_dir, path)
        made[(model_dir, path)] = llm  # most recently used last
        while len(made) > _MAX_OPEN_ENGINES:
            made.pop(next(iter(made))).close()
        return llm

    yield get
    for llm in made.values():
        llm.close()


# ---------------------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="session")
def base(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """(arch, **preset fields) -> a dense tiny checkpoint with 128-aligned widths (made once)."""
    made: dict[tuple, Path] = {}

    def get(arch: str, **fields: int) -> Path:
        key = (arch, tuple(sorted(fields.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"dense-{arch}")
            made[key] = make_tiny_model(out, arch=arch, preset="tiny", seed=0, **{**SHAPES, **fields})
        return made[key]

    return get


@pytest.fixture(scope="session")
def quantized(base: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Path]]:
    """(arch, fmt, group_size=128, fp16_scales=None, **preset fields) -> (quantized checkpoint, its dense
    dequantized twin)."""
    made: dict[tuple, tuple[Path, Path]] = {}

    def get(arch: str, fmt: str, group_size: int = 128, fp16_scales: bool | None = None,
            **fields: int) -> tuple[Path, Path]:  # fmt: skip
        key = (arch, fmt, group_size, fp16_scales, tuple(sorted(fields.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}-{fmt}")
            ref = tmp_path_factory.mktemp(f"{arch}-{fmt}-reference")
            quantize_checkpoint(base(arch, **fields), out, fmt, group_size=group_size, reference_dir=ref,
                                fp16_scales=fp16_scales)  # fmt: skip
            made[key] = (out, ref)
        return made[key]

    return get


@dataclass(frozen=True)
class Reference:
    tokens: list[list[int]]  # per prompt: greedy tokens
    logprobs: list[list[torch.Tensor]]  # per prompt and step: [vocab] log-softmax, teacher-forced on `tokens`


_REFERENCES: dict[tuple[Path, torch.dtype], Reference] = {}


def hf_reference(model_dir: Path, prompts: list[list[int]], dtype: torch.dtype = torch.float32) -> Reference:
    """transformers' greedy tokens and each step's log-probabilities in `dtype` (loading quantized checkpoints
    through its compressed-tensors quantizer), one prompt at a time."""
    if (model_dir, dtype) in _REFERENCES:
        return _REFERENCES[model_dir, dtype]
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=dtype).eval()
    tokens, logprobs = [], []
    for prompt in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        tokens.append(out.sequences[0, len(prompt) :].tolist())
        logprobs.append([torch.log_softmax(step[0].float(), -1) for step in out.logits])
    _REFERENCES[model_dir, dtype] = Reference(tokens, logprobs)
    return _REFERENCES[model_dir, dtype]


def check_greedy(llm: LLM, prompts: list[list[int]], ref: Reference, atol: float = WEIGHT_ONLY_ATOL) -> None:
    """Free-running greedy decoding: the reference's tokens, chosen-token logprobs within `atol`."""
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    for out, tokens, lps in zip(llm.generate(prompts, params), ref.tokens, ref.logprobs, strict=True):
        assert out.token_ids == tokens, f"a prompt of {len(out.prompt_token_ids)} tokens diverged"
        got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        assert got == pytest.approx([lp[t].item() for lp, t in zip(lps, tokens, strict=True)], abs=atol)


def teacher_forced(llm: LLM, prompts: list[list[int]], ref: Reference) -> tuple[list[float], list[float]]:
    """Each position's next token from the reference's own prefix: (|logprob difference| of the reference's token
    at every position, the reference's top-1 margin at every position where the greedy token differs)."""
    forced = [p + tokens[:i] for p, tokens in zip(prompts, ref.tokens, strict=True) for i in range(NUM_NEW_TOKENS)]
    outs = llm.generate(forced, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=20))
    diffs, margins = [], []
    expected = [(tokens[i], lps[i]) for tokens, lps in zip(ref.tokens, ref.logprobs, strict=True)
                for i in range(NUM_NEW_TOKENS)]  # fmt: skip
    for out, (token, lps) in zip(outs, expected, strict=True):
        diffs.append(abs(out.logprobs[0].get(token, -1e9) - lps[token].item()))
        if out.token_ids[0] != token:
            top2 = lps.topk(2).values
            margins.append((top2[0] - top2[1]).item())
    return diffs, margins


def check_teacher_forced(llm: LLM, prompts: list[list[int]], ref: Reference) -> None:
    diffs, margins = teacher_forced(llm, prompts, ref)
    assert sum(diffs) / len(diffs) <= ACT_MEAN and max(diffs) <= ACT_MAX, (sum(diffs) / len(diffs), max(diffs))
    assert all(m <= ACT_MAX for m in margins), f"greedy tokens differ where the reference's margin was {margins}"


# ------------------------------------------------------------------------------------------------ accuracy


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("arch", "fmt", "group_size", "against"),
    [
        ("qwen3", "w4a16", 128, "checkpoint"),  # transformers' compressed-tensors loading
        ("qwen3", "w4a16", 64, "checkpoint"),
        ("qwen3", "w4a16-asym", 128, "dense"),  # transformers cannot load packed zero points: the dense twin
        ("qwen2", "awq", 128, "dense"),  # qkv bias kept beside the quantized q/k/v
    ],
)
def test_int4_formats_give_the_reference_greedy_tokens(arch: str, fmt: str, group_size: int, against: str,
                                                       path: str, quantized: Callable, engine: Callable) -> None:  # fmt: skip
    model_dir, dense = quantized(arch, fmt, group_size)
    prompts = _prompts()
    check_greedy(engine(model_dir, path), prompts, hf_reference(model_dir if against == "checkpoint" else dense, prompts))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-dynamic", "fp8-block", "w8a8"])
def test_activation_quantized_formats_match_transformers_teacher_forced(fmt: str, path: str, quantized: Callable,
                                                                         engine: Callable) -> None:  # fmt: skip
    model_dir, _ = quantized("qwen3", fmt)
    prompts = _prompts()
    check_teacher_forced(engine(model_dir, path), prompts, hf_reference(model_dir, prompts))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_engine_runs_int4_layers_through_the_w4a16_kernel_it_picked(quantized: Callable, engine: Callable,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """MMSERVE_W4A16_BACKEND=triton (here in Triton's interpreter, the conftest's TRITON_INTERPRET=1): the engine's
    int4 layers run the Triton kernel and give the torch twin's tokens, logprobs within fp32 summation order."""
    model_dir, _ = quantized("qwen3", "w4a16-asym")
    prompts, params = _prompts()[:2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
    expected = engine(model_dir, "native").generate(prompts, params)
    monkeypatch.setenv("MMSERVE_W4A16_BACKEND", "triton")
    with _llm(model_dir, "native") as llm:
        got = llm.generate(prompts, params)
    for a, b in zip(got, expected, strict=True):
        assert a.token_ids == b.token_ids
        chosen = [(x[t], y[t]) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids, strict=True)]
        assert all(abs(x - y) < 1e-4 for x, y in chosen)
    # The runner consulted the choice at load: compiled Triton kernels cannot run on the CPU, and say so.
    from mmserve.kernels import triton_w4a16

    monkeypatch.setattr(triton_w4a16, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _llm(model_dir, "native")


def test_awq_and_compressed_tensors_asymmetric_int4_of_the_same_weights_give_the_same_output(
    quantized: Callable,
) -> None:
    """AWQ's interleaved, transposed layout and compressed-tensors' packing of the same codes, zero points and
    (fp16-representable) scales load to the same weights: identical outputs, bit for bit."""
    awq_dir, _ = quantized("qwen2", "awq")
    ct_dir, _ = quantized("qwen2", "w4a16-asym", fp16_scales=True)
    outputs = []
    for model_dir in (awq_dir, ct_dir):
        llm = _llm(model_dir, "native")
        outputs.append([(o.token_ids, o.logprobs) for o in llm.generate(_prompts(), GREEDY)])
        llm.close()
    assert outputs[0] == outputs[1]


def test_qwen_fp8_equals_its_compressed_tensors_twin_and_keeps_the_vision_tower(quantized: Callable) -> None:
    """Qwen3-VL's FP8 layout (weight_scale_inv per 128x128 block, quant_method fp8) against transformers running
    the compressed-tensors fp8-block checkpoint of the same codes (which quantizes activations per token group,
    as vLLM does for Qwen's FP8); mmserve gives the two checkpoints identical outputs, an image included (the
    vision tower is left unquantized and encodes)."""
    qwen_dir, _ = quantized("qwen3_vl", "qwen-fp8")
    ct_dir, _ = quantized("qwen3_vl", "fp8-block")
    quant = json.loads((qwen_dir / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "fp8" and any("visual" in m for m in quant["modules_to_not_convert"])
    prompts = _prompts()
    image = {"prompt": user("image", "What is this?", system=None), "images": [IMG_SMALL]}
    outputs = []
    for model_dir in (qwen_dir, ct_dir):
        llm = _llm(model_dir, "native")
        outputs.append([(o.token_ids, o.logprobs) for o in llm.generate([*prompts, image], GREEDY)])
        if model_dir == qwen_dir:  # after: its prefix-cache hits would change the batches' shapes above
            check_teacher_forced(llm, prompts, hf_reference(ct_dir, prompts))
        llm.close()
    assert outputs[0] == outputs[1]


GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


# -------------------------------------------------------------------------------------------------- memory


def _projections(cfg: DecoderConfig) -> list[tuple[int, int]]:
    """(N, K) of every quantized projection: q/k/v fused, o, gate/up fused, down, per layer."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer = [(qkv, cfg.hidden_size), (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
                 (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]  # fmt: skip
    return per_layer * cfg.num_layers


@pytest.mark.parametrize(
    ("fmt", "stored_bytes"),
    [
        # int4 codes (half a byte each), an fp32 scale and a uint8 zero point per row and group of 128
        ("w4a16-asym", lambda n, k: n * k // 2 + n * (k // 128) * (4 + 1)),
        ("fp8-dynamic", lambda n, k: n * k + n * 4),  # one byte per code, an fp32 scale per row
        ("fp8-block", lambda n, k: n * k + n * (k // 128) * 4),  # a block's scale repeated over its 128 rows
    ],
)
def test_the_native_path_holds_the_quantized_bytes_and_the_dequantized_path_full_weights(
    fmt: str, stored_bytes: Callable[[int, int], int], quantized: Callable, engine: Callable
) -> None:
    model_dir, _ = quantized("qwen3", fmt)
    cfg, _ = DecoderConfig.from_pretrained(model_dir)
    held = {path: engine(model_dir, path).info().weight_bytes for path in PATHS}
    dense_projections = sum(n * k * 4 for n, k in _projections(cfg))  # fp32 in the dequantized path
    quantized_projections = sum(stored_bytes(n, k) for n, k in _projections(cfg))
    assert held["native"] == held["dequantized"] - dense_projections + quantized_projections
    assert held["native"] < 0.6 * held["dequantized"]
    # What sizes a GPU's KV pool before the weights load (fp32 here, the engine's CPU default; no norms counted)
    for path in PATHS:
        assert _approx_weight_bytes(cfg, torch.float32, path) == pytest.approx(held[path], rel=0.01), path


def test_the_compute_path_knob() -> None:
    w4 = parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"})
    fp8 = parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert w4 is not None and fp8 is not None
    scheme_w4, scheme_fp8 = w4.groups[0].scheme, fp8.groups[0].scheme
    assert resolve_compute_path(scheme_w4, "auto") is ComputePath.NATIVE
    assert resolve_compute_path(scheme_fp8, "dequantized") is ComputePath.DEQUANTIZED
    with _compute_path("native"):
        assert resolve_compute_path(scheme_fp8) is ComputePath.NATIVE  # the environment when no keyword
        assert resolve_compute_path(scheme_fp8, "dequantized") is ComputePath.DEQUANTIZED  # the keyword wins
    with pytest.raises(ValueError, match="auto, dequantized or native"):
        resolve_compute_path(scheme_w4, "fast")
    with pytest.raises(InvalidRequestError, match="quant_compute"):
        EngineArgs("unused", quant_compute="fast")


def test_auto_runs_fp8_gemms_where_the_device_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 per-channel weights with per-token fp8 activations: dequantized at load on the CPU, native (fp8 GEMMs)
    where `torch._scaled_mm` has fp8 kernels; block-wise fp8 dequantized either way."""
    dynamic = parse_quantization_config(_fp8_dynamic_config())
    block = parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert dynamic is not None and block is not None
    scheme, scheme_block = dynamic.groups[0].scheme, block.groups[0].scheme
    cuda = torch.device("cuda")
    assert resolve_compute_path(scheme, "auto", torch.device("cpu")) is ComputePath.DEQUANTIZED
    monkeypatch.setattr(quant_linear, "fp8_gemm_available", lambda device: device.type == "cuda")
    assert resolve_compute_path(scheme, "auto", cuda) is ComputePath.NATIVE
    assert resolve_compute_path(scheme_block, "auto", cuda) is ComputePath.DEQUANTIZED


def _fp8_dynamic_config() -> dict:
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
              "symmetric": True, "dynamic": False}, "input_activations": {"num_bits": 8, "type": "float",
              "strategy": "token", "symmetric": True, "dynamic": True}}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": scheme}}


@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-dynamic"])
def test_fp8_gemms_equal_the_dequantized_weights(fmt: str, quantized: Callable,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The native path's fp8 x fp8 GEMM (`torch._scaled_mm` with row-wise scales: on GPUs with fp8 tensor cores,
    and here on the CPU's own `_scaled_mm`, forced) against the same codes dequantized: every projection's output
    equal up to the order of fp32 sums."""
    model_dir, _ = quantized("qwen3", fmt)
    dequantized = _shard(model_dir, 0, 1, "dequantized")
    monkeypatch.setattr(quant_linear, "fp8_gemm_available", lambda device: True)
    native = _shard(model_dir, 0, 1, "native")
    calls = 0
    original = QuantizedLinear._fp8_matmul

    def counted(self: QuantizedLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return original(self, x, bias)

    monkeypatch.setattr(QuantizedLinear, "_fp8_matmul", counted)
    torch.manual_seed(0)
    layers = [(n, m) for n, m in native.named_modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.fp8_matmul and m.weight is None for _, m in layers)
    with torch.inference_mode():
        for name, layer in layers:
            x = torch.randn(7, layer.in_features)
            expected = dequantized.get_submodule(name)(x)
            assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-5), name
    assert calls == len(layers)


# -------------------------------------------------------------------------------------- tensor parallelism


@dataclass(frozen=True)
class _LoneRank:
    """One rank of a group whose collectives never run: its shard loads alone, in this process, and a
    row-parallel layer returns its partial sum (the test adds them up)."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _shard(model_dir: Path, rank: int, world_size: int, path: str) -> torch.nn.Module:
    cfg, _ = DecoderConfig.from_pretrained(model_dir)
    backend = AttentionBackend("none", lambda *a: None, lambda *a: None)
    tp = TensorParallelGroup.single() if world_size == 1 else _LoneRank(rank, world_size)
    return load_decoder(model_dir, cfg, backend, tp, quant_compute=path)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fmt", "path"), [("w4a16-asym", "native"), ("fp8-block", "native"), ("awq", "dequantized")])
def test_each_rank_holds_its_slice_of_every_quantized_projection(fmt: str, path: str, quantized: Callable) -> None:
    """Two ranks' shards, loaded in this process: column-parallel outputs are the whole layer's output rows of
    each part, row-parallel partial outputs sum to the whole layer's output (scales, zero points and packed words
    sliced with their weights)."""
    arch = "qwen2" if fmt == "awq" else "qwen3"
    model_dir, _ = quantized(arch, fmt)
    whole = _shard(model_dir, 0, 1, path)
    ranks = [_shard(model_dir, r, 2, path) for r in range(2)]
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, layer in whole.named_modules():
            if not isinstance(layer, QuantizedLinear):
                continue
            shards = [r.get_submodule(name) for r in ranks]
            if layer.tp is None and shards[0].tp is None:  # column-parallel: the rank's rows of each part
                x = torch.randn(5, layer.in_features)
                full = layer(x)
                for shard in shards:
                    rows, offset = [], 0
                    for part in shard.parts:
                        rows += range(offset + part.start, offset + part.start + part.length)
                        offset += part.size
                    assert torch.allclose(shard(x), full[:, rows], atol=1e-5), name
            else:  # row-parallel: each rank's input columns, partial outputs summed
                x = torch.randn(5, layer.in_features)
                parts = [s(x[:, s.in_part.start : s.in_part.start + s.in_part.length]) for s in shards]
                # fp8-block's activation groups of 128 lie within a rank's columns: the same codes as one rank's
                assert torch.allclose(parts[0] + parts[1], layer(x), atol=1e-4), name


def test_a_split_off_a_group_boundary_is_refused(quantized: Callable) -> None:
    """down_proj's 384 input columns split into 192 per rank: not whole groups of 128."""
    model_dir, _ = quantized("qwen3", "w4a16", intermediate=384)
    _shard(model_dir, 0, 1, "native")  # one rank holds whole groups
    with pytest.raises(ValueError, match=r"mlp\.down_proj.*192 input columns .* 128-column quantization group"):
        _shard(model_dir, 1, 2, "native")


def test_two_rank_engine_equals_one_rank(quantized: Callable) -> None:
    model_dir, _ = quantized("qwen3", "w4a16")
    prompts = _prompts()
    one = _llm(model_dir, "native")
    expected = one.generate(prompts, GREEDY)
    one.close()
    two = _llm(model_dir, "native", tensor_parallel_size=2)
    try:
        for a, b in zip(two.generate(prompts, GREEDY), expected, strict=True):
            assert a.token_ids == b.token_ids
            got, want = (
                [lp[t] for lp, t in zip(o.logprobs, o.token_ids, strict=True)] for o in (a, b)
            )
            assert got == pytest.approx(want, abs=1e-4)
    finally:
        two.close()


# --------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "gptq", "bits": 4}, "quantization method 'gptq' is not supported"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ version 'gemv'"),
        ({"quant_method": "awq", "bits": 3, "version": "gemm"}, "3-bit weights"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "'static'"),
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
            "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                               "group_size": 16}}}}, "4-bit float weights are not supported"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
         "static activation scales"),
        ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {"g": {
            "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                               "group_size": 128}}}}, "format 'marlin-24' is not supported"),
    ],
)  # fmt: skip
def test_unsupported_schemes_are_refused_by_name(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(config)


def _edited_copy(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _key(tensors: dict[str, torch.Tensor], suffix: str) -> str:
    return next(k for k in tensors if k.endswith(suffix))


def test_misshapen_missing_and_unplaced_quantized_tensors_are_refused(quantized: Callable, tmp_path: Path) -> None:
    model_dir, _ = quantized("qwen3", "fp8-block")

    def wrong_scale(t: dict[str, torch.Tensor]) -> None:
        key = _key(t, "layers.1.mlp.down_proj.weight_scale")
        t[key] = torch.ones(3, 3)

    def no_scale(t: dict[str, torch.Tensor]) -> None:
        del t[_key(t, "layers.0.self_attn.k_proj.weight_scale")]

    def quantized_lm_head(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight_scale"] = torch.ones(1)

    cases = [
        (wrong_scale, r"down_proj.*shape \(3, 3\) != expected \(2, 4\)"),
        (no_scale, r"missing decoder weights: \['layers\.0\.self_attn\.qkv_proj\.weight_scale#1'\]"),
        (quantized_lm_head, "a quantized lm_head is not supported"),
    ]
    for i, (edit, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            _llm(_edited_copy(model_dir, tmp_path / str(i), edit), "native")


def test_quantized_codes_without_a_scheme_are_refused(quantized: Callable, tmp_path: Path) -> None:
    """fp8 weights in a checkpoint whose config lost its quantization_config would be read as numbers."""
    model_dir, _ = quantized("qwen3", "fp8-block")
    out = tmp_path / "no-config"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="F8_E4M3 values, but no quantization scheme covers it"):
        _llm(out, "native")


def test_a_quantized_vision_tower_is_refused(base: Callable, tmp_path: Path) -> None:
    out = quantize_checkpoint(base("qwen3_vl"), tmp_path / "vision", "fp8-dynamic", quantize_vision=True)
    with pytest.raises(ValueError, match=r"the vision tower is quantized \(.*visual.*weight"):
        _llm(out, "native")


def test_tp_boundaries_of_packed_words_and_groups_are_checked() -> None:
    """The formats' own checks: a packed int4 split inside an int32 word, an fp8 split inside a block."""
    w4 = parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"})
    assert w4 is not None
    scheme = w4.groups[0].scheme
    qweight = torch.zeros(256, 64, dtype=torch.int32)  # AWQ: [K, N / 8], output columns packed
    read = lambda dim, start, length: qweight.narrow(dim, start, length)  # noqa: E731
    with pytest.raises(ValueError, match="does not fall on a 8-value int32 word boundary"):
        read_local(scheme, "qweight", (256, 64), read, Span(512, 4, 252), Span(256, 0, 256))
    fp8 = parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert fp8 is not None
    staged = {"weight": torch.zeros(256, 64, dtype=torch.float8_e4m3fn), "weight_scale_inv": torch.ones(2, 2)}
    with pytest.raises(ValueError, match=r"64 input columns .* 128-column quantization block"):
        to_canonical(fp8.groups[0].scheme, staged, Span(256, 0, 256), Span(256, 64, 64))


# ---------------------------------------------------------------------------------------------------- bench


def test_bench_quantization_reports_bytes_accuracy_and_speed_per_path(base: Callable) -> None:
    from mmserve.bench.quantization import (
        BENCH_FORMATS,
        QuantizationBenchConfig,
        bench_quantization,
        format_report,
    )
    from mmserve.quantize import FORMATS

    assert BENCH_FORMATS == FORMATS  # the CLI's torch-free copy
    cfg = QuantizationBenchConfig(formats=("w4a16",), dtype="float32", accuracy_prompts=2, accuracy_tokens=3,
                                  prompt_len=8, prefill_prompts=1, prefill_len=32, decode_batch=2, decode_tokens=3,
                                  repeats=1)  # fmt: skip
    report = bench_quantization(base("qwen3"), cfg)
    dense, dequantized, native = report["results"]
    assert (dense["format"], dequantized["path"], native["path"]) == ("dense", "dequantized", "native")
    assert dequantized["weight_bytes"] == dense["weight_bytes"]  # fp32 weights either way
    assert native["weight_bytes_ratio"] < 0.6
    for row in (dequantized, native):
        assert 0 < row["mean_abs_logprob_diff"] <= row["max_abs_logprob_diff"]  # quantization changed something
        assert 0 <= row["greedy_token_agreement"] <= 1 and 0 <= row["teacher_forced_top1_agreement"] <= 1
    # The two paths compute one function (up to float rounding order).
    assert native["mean_abs_logprob_diff"] == pytest.approx(dequantized["mean_abs_logprob_diff"], abs=1e-3)
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["decode_batch1_tok_s"] > 0
               for r in report["results"])  # fmt: skip
    assert "w4a16" in format_report(report) and report["machine"]["cpu"]
    with pytest.raises(ValueError, match="formats: choose from"):
        QuantizationBenchConfig(formats=("int3",))
