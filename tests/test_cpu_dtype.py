"""The default compute dtype (engine/device.py): bf16 on CUDA and on CPUs with native bf16 (AVX-512 BF16, AMX),
fp32 elsewhere, `--dtype` / $MMSERVE_DTYPE overriding; and what bf16 serving promises: transformers' own bf16
numbers within a stated bound (teacher-forced), and the same output for the same requests scheduled alike.
Greedy bf16 output is not promised across different batch compositions, chunk boundaries or prefix-cache
hits (a GEMM's rounding depends on its shape); the fp32 parity suites make those promises in fp32."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.engine import device as engine_device
from mmserve.engine.device import DTYPE_ENV, cpu_has_native_bf16, default_dtype, resolve_dtype
from tests.test_quantized_checkpoints import hf_reference, teacher_forced

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# bf16 against transformers in bf16, teacher-forced on the tiny checkpoint: both round every product to bf16
# but in different orders and kernels (paged attention, fused q/k/v), so logprobs differ by the format's
# rounding, not by more (measured: mean 0.035, max 0.12; an fp32 engine against transformers' bf16 gives 0.071,
# a bf16 engine against transformers' fp32 0.054: the bound tells the dtypes apart).
BF16_MEAN, BF16_MAX = 0.05, 0.2


def test_the_default_follows_the_device_and_the_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(DTYPE_ENV, raising=False)
    assert resolve_dtype(None, CUDA) == "bfloat16"
    monkeypatch.setattr(engine_device, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype(None, CPU) == resolve_dtype("auto", CPU) == "bfloat16"
    monkeypatch.setattr(engine_device, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype(None, CPU) == "float32"
    assert resolve_dtype("float16", CPU) == "float16"  # given: as given
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    assert resolve_dtype(None, CPU) == "bfloat16" and resolve_dtype("float32", CPU) == "float32"
    monkeypatch.setenv(DTYPE_ENV, "fp64")
    with pytest.raises(ValueError, match=DTYPE_ENV):
        resolve_dtype(None, CPU)
    # The CPU's flags, as /proc/cpuinfo lists them.
    read = cpu_has_native_bf16.__wrapped__
    for flags, native in (("fpu avx2 avx512f avx512_bf16", True), ("fpu amx_tile amx_bf16", True),
                          ("fpu avx2 avx512f avx512_vnni", False)):  # fmt: skip
        info = tmp_path / f"cpuinfo-{native}-{len(flags)}"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert read(info) is (native and torch.backends.mkldnn.is_available())
    assert read(tmp_path / "missing") is False


def test_an_engine_given_no_dtype_runs_the_default(tiny_model_dir: Callable[[str], Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.delenv(DTYPE_ENV)
    with LLM(tiny_model_dir("qwen2"), num_kv_blocks=64) as llm:
        assert llm.info().dtype == default_dtype(CPU)


def test_bf16_matches_transformers_in_bf16_and_repeats_itself(tiny_model_dir: Callable[[str], Path]) -> None:
    model = tiny_model_dir("qwen2")
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 4000) for _ in range(n)] for n in (5, 23, 70)]
    # No prefix cache: a repeated request is recomputed in the same steps as the first time.
    with LLM(model, dtype="bfloat16", num_kv_blocks=256, enable_prefix_caching=False) as llm:
        diffs, margins = teacher_forced(llm, prompts, hf_reference(model, prompts, torch.bfloat16))
        assert sum(diffs) / len(diffs) <= BF16_MEAN and max(diffs) <= BF16_MAX, (sum(diffs) / len(diffs), max(diffs))
        assert all(m <= BF16_MAX for m in margins), margins
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
        runs = [[(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)] for _ in range(2)]
    assert runs[0] == runs[1]
