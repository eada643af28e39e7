"""The CPU's few-row linear products (kernels/cpu_linear.py): the C kernel against its torch twin (F.linear) at
the shapes the engine uses, in fp32 and bf16; the row-count buckets; the measured choice, cached once per machine
and model, re-measured when stale, and never cached when measured beside other work; and an engine on measured
paths against one on BLAS alone."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmserve import LLM, SamplingParams
from mmserve.kernels import cpu_linear
from mmserve.kernels.cpu_linear import MAX_ROWS, ROW_BUCKETS, LinearPaths, choose_paths, small_linear

C_KERNEL = cpu_linear.load() is not None
needs_c = pytest.mark.skipif(not C_KERNEL, reason="no C compiler")
CPU = torch.device("cpu")
# (out_features, in_features): the bench preset's qkv, o, gate_up, down; the tiny checkpoints'; and widths that
# are not a multiple of the kernel's 16 lanes (the masked tail) nor of its 4-row weight tile.
SHAPES = [(768, 512), (512, 512), (5632, 512), (512, 2816), (96, 64), (33, 70), (5, 16), (7, 3)]


def _operands(rows: int, out_f: int, in_f: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    return x, w, b


@needs_c
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 64, 128])
@pytest.mark.parametrize("bias", [False, True])
def test_c_kernel_equals_f_linear_in_fp32(rows: int, bias: bool) -> None:
    for out_f, in_f in SHAPES:
        x, w, b = _operands(rows, out_f, in_f, torch.float32, bias)
        got = small_linear(x, w, b)
        assert got.shape == (rows, out_f) and got.dtype == torch.float32 and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_c
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 32])
def test_c_kernel_in_bf16_is_the_fp32_product_rounded_once(rows: int) -> None:
    """bf16 operands, fp32 sums, one rounding to bf16 at the end: within one bf16 step of the exact product
    rounded (the sums' order differs), where torch's own bf16 product may be further off."""
    for out_f, in_f in SHAPES:
        x, w, b = _operands(rows, out_f, in_f, torch.bfloat16, True)
        exact = F.linear(x.double(), w.double(), b.double())
        got = small_linear(x, w, b)
        assert got.dtype == torch.bfloat16
        step = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-3)
        assert ((got.double() - exact).abs() <= step + 1e-6).all()


@needs_c
def test_c_kernel_takes_a_column_major_x_and_is_batch_invariant() -> None:
    """x as the previous layer's (W @ x^T)^T leaves it (a transposed view); and a row's result does not depend
    on the rows beside it (each output is one dot product, summed alike whatever the batch)."""
    x, w, b = _operands(12, 768, 512, torch.float32, True)
    column_major = x.t().contiguous().t()
    assert not column_major.is_contiguous()
    torch.testing.assert_close(small_linear(column_major, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    alone = torch.cat([small_linear(x[i : i + 1], w, b) for i in range(12)])
    assert torch.equal(small_linear(x, w, b), alone)
    assert torch.equal(small_linear(x[5:9], w, b), alone[5:9])


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_f", [512, 523])  # 523: a tail after the vectors
def test_a_row_sums_alike_whatever_rows_share_its_call(dtype: torch.dtype, in_f: int) -> None:
    """Every count of rows sharing a tile (1-8; 1-4 with AVX-512), either tile width (AVX-512: 1 weight row up to 8
    rows, 4 past that; 42 weight rows leave a partial one), and tiles split across calls: bit-identical."""
    x, w, b = _operands(17, 42, in_f, dtype, True)
    alone = torch.cat([small_linear(x[i : i + 1], w, b) for i in range(17)])
    for rows in range(2, 18):
        assert torch.equal(small_linear(x[:rows], w, b), alone[:rows]), rows
    assert torch.equal(small_linear(x[3:14], w, b), alone[3:14])


def test_inputs_the_kernel_does_not_take_fall_back_to_blas() -> None:
    x, w, b = _operands(3, 40, 24, torch.float64, True)  # fp64: not the kernel's
    torch.testing.assert_close(small_linear(x, w, b), F.linear(x, w, b))
    x32, w32, _ = _operands(3, 40, 24, torch.float32, False)
    strided = w32.t().contiguous().t()  # a non-contiguous weight
    torch.testing.assert_close(small_linear(x32, strided), F.linear(x32, strided), rtol=1e-5, atol=1e-5)


def test_row_buckets_choose_the_path() -> None:
    paths = LinearPaths(("c",) * 4 + ("mm_t",) * 6 + ("linear",) * 4)
    assert [paths.path(r) for r in (1, 4, 5, 6, 32, 33, 128, 129, 4096)] == [
        "c", "c", "mm_t", "mm_t", "mm_t", "linear", "linear", "linear", "linear"
    ]  # fmt: skip
    assert paths.describe() == "rows 1-4: c, 5-32: mm_t, 33-128: linear"
    assert LinearPaths.uniform("mm_t").describe() == f"rows 1-{MAX_ROWS}: mm_t"
    for bad in (("c",) * 3, ("gemv",) * len(ROW_BUCKETS)):
        with pytest.raises(ValueError, match="row bucket"):
            LinearPaths(bad)
    x, w, b = _operands(5, 64, 48, torch.float32, True)
    for path in ("mm_t", "linear", "c"):
        torch.testing.assert_close(
            LinearPaths.uniform(path).linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5
        )


def test_a_forced_path_is_taken_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    weights = [_operands(1, 64, 48, torch.float32, True)[1:]]
    monkeypatch.setenv(cpu_linear.ENV, "linear")
    assert choose_paths(CPU, weights) == LinearPaths.uniform("linear")
    assert choose_paths(CPU, weights, "mm_t") == LinearPaths.uniform("mm_t")  # an argument wins
    monkeypatch.setenv(cpu_linear.ENV, "gemv")
    with pytest.raises(ValueError, match="MMSERVE_CPU_LINEAR"):
        choose_paths(CPU, weights)


@needs_c
def test_auto_measures_once_and_caches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MMSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_linear, "_STABLE_SPREAD", float("inf"))  # whatever else runs on these cores
    weights = [_operands(1, o, i, torch.float32, True)[1:] for o, i in SHAPES[:4]]
    calls: list[int] = []
    measure = cpu_linear._measure

    def counting(*args, **kwargs):
        calls.append(1)
        return measure(*args, **kwargs)

    monkeypatch.setattr(cpu_linear, "_measure", counting)
    chosen = choose_paths(CPU, weights, "auto")
    entries = json.loads((tmp_path / "cpu-linear-paths.json").read_text())
    (entry,) = entries.values()
    assert entry["paths"] == list(chosen.paths) and entry["candidates"] == ["mm_t", "linear", "c"]
    assert set(entry["ms_per_pass"]) == {str(r) for r in ROW_BUCKETS}
    assert choose_paths(CPU, weights, "auto") == chosen and len(calls) == 1  # the second start reads the cache
    # Another dtype (or shapes, threads, CPU, torch, kernel source) is another entry, measured once.
    bf16 = [(w.bfloat16(), b.bfloat16()) for w, b in weights]
    choose_paths(CPU, bf16, "auto")
    assert len(calls) == 2 and len(json.loads((tmp_path / "cpu-linear-paths.json").read_text())) == 2
    # A damaged entry is measured again; off the CPU nothing is measured.
    (tmp_path / "cpu-linear-paths.json").write_text(json.dumps({k: {"paths": ["?"]} for k in entries}))
    choose_paths(CPU, weights, "auto")
    assert len(calls) == 3
    assert choose_paths(torch.device("meta"), weights, "auto") == cpu_linear.BLAS_PATHS and len(calls) == 3


def test_a_measurement_beside_other_work_is_not_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MMSERVE_KERNEL_CACHE", str(tmp_path))
    unstable = (("linear",) * len(ROW_BUCKETS), {}, False)
    monkeypatch.setattr(cpu_linear, "_measure", lambda *args: unstable)
    weights = [_operands(1, 64, 48, torch.float32, True)[1:]]
    assert choose_paths(CPU, weights, "auto") == LinearPaths.uniform("linear")  # used for this start
    assert not (tmp_path / "cpu-linear-paths.json").exists()


@needs_c
def test_an_engine_on_measured_paths_matches_one_on_blas(
    tiny_model_dir: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Greedy output through the measured paths (mixed decode row counts as requests finish) equals BLAS's;
    the runner hands every linear layer the same paths, measured at its start (cached, or — measured beside
    other work on these cores — said so and not cached)."""
    monkeypatch.setenv("MMSERVE_KERNEL_CACHE", str(tmp_path))
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 3 * i))} for i in range(6)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    outputs = {}
    caplog.set_level(logging.WARNING, logger=cpu_linear.__name__)
    for setting in ("mm_t", "auto", "c"):
        monkeypatch.setenv(cpu_linear.ENV, setting)
        with LLM(tiny_model_dir("qwen2"), num_kv_blocks=64) as llm:
            outputs[setting] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["auto"] == outputs["mm_t"] == outputs["c"]
    unstable = "measured beside other work" in caplog.text
    assert (tmp_path / "cpu-linear-paths.json").exists() != unstable
