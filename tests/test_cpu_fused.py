"""The decoder's fused elementwise C kernels (`kernels/cpu_fused.py`) against their torch twins in
`kernels/reference.py`: both dtypes, transposed inputs (the linear layers' column-major results), the Qwen3
q/k norms, decode and prefill row counts; the fallbacks; and the decoder run through either set of ops."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mmserve.kernels import cpu_fused, dispatch, reference
from tests.test_kernels import python_with_kernel_cache

pytestmark = pytest.mark.skipif(not cpu_fused.load(), reason="no C compiler")


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16: equal but for a rare last-place rounding of a row's sum of squares; fp32 to a few ulps."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.bfloat16:
        assert (got != expected).float().mean() < 0.01
        torch.testing.assert_close(got, expected, atol=0.02, rtol=0.01)
    else:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _transposed(x: torch.Tensor) -> torch.Tensor:
    """x's values as a column-major view (what the transposed linear product returns)."""
    return x.t().contiguous().t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_its_twin(dtype: torch.dtype, rows: int, with_residual: bool) -> None:
    torch.manual_seed(rows)
    x = (torch.randn(rows, 96) * 3).to(dtype)
    residual = torch.randn(rows, 96).to(dtype) if with_residual else None
    weight = torch.randn(96).to(dtype)
    for xs in (x, _transposed(x)):
        before = None if residual is None else residual.clone()
        out, summed = cpu_fused.add_rms_norm(xs, residual, weight, 1e-6)
        ref_out, ref_summed = reference.add_rms_norm(xs, residual, weight, 1e-6)
        _close(out, ref_out)
        assert torch.equal(summed, ref_summed)  # one rounding of one sum: exact
        if residual is None:
            assert summed is xs
        else:
            assert torch.equal(residual, before)  # inputs are never written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_silu_and_mul_matches_its_twin(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 700) * 4).to(dtype)  # more than one of the kernel's chunks per row
    expected = reference.silu_and_mul(gate_up)
    _close(cpu_fused.silu_and_mul(gate_up), expected)
    _close(cpu_fused.silu_and_mul(_transposed(gate_up)), expected)


def _rotary(rows: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(rows).float()[:, None] * inv_freq * 7
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [rows, 1, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 70])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_qk_matches_its_twin(dtype: torch.dtype, rows: int, qk_norm: bool) -> None:
    torch.manual_seed(rows)
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    cos, sin = _rotary(rows, head_dim, dtype)
    norms = (torch.randn(head_dim).to(dtype), torch.randn(head_dim).to(dtype), 1e-6) if qk_norm else ()
    ref_q, ref_k = reference.rotary_qk(qkv, cos, sin, num_heads, num_kv_heads, *norms)
    for source in (qkv, _transposed(qkv)):
        q, k = cpu_fused.rotary_qk(source, cos, sin, num_heads, num_kv_heads, *norms)
        _close(q, ref_q)
        _close(k, ref_k)
    with pytest.raises(ValueError, match="both"):
        reference.rotary_qk(qkv, cos, sin, num_heads, num_kv_heads, torch.ones(head_dim, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_cache_matches_its_twin_and_refuses_a_slot_outside_the_cache(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    qkv = torch.randn(6, 4 * 8).to(dtype)
    key = torch.randn(6, 2, 8).to(dtype)
    value = _transposed(qkv)[:, 16:].view(6, 2, 8)  # a strided view, as the decoder passes V
    slots = torch.tensor([5, 0, 9, 31, 17, 2])
    got, expected = torch.zeros(2, 8, 4, 2, 8, dtype=dtype), torch.zeros(2, 8, 4, 2, 8, dtype=dtype)
    cpu_fused.store_kv_cache(key, value, got, slots)
    reference.store_kv_cache(key, value, expected, slots)
    assert torch.equal(got, expected) and got.count_nonzero() > 0
    before = got.clone()
    with pytest.raises(IndexError):
        cpu_fused.store_kv_cache(key, value, got, torch.tensor([1, 2, 3, 4, 5, 32]))
    assert torch.equal(got, before)  # nothing written


def test_inputs_the_kernels_do_not_take_go_to_the_twin() -> None:
    x = torch.randn(3, 32, dtype=torch.float64)
    weight = torch.randn(32, dtype=torch.float64)
    out, summed = cpu_fused.add_rms_norm(x, x, weight, 1e-6)
    ref_out, ref_summed = reference.add_rms_norm(x, x, weight, 1e-6)
    assert torch.equal(out, ref_out) and torch.equal(summed, ref_summed)
    mixed = cpu_fused.add_rms_norm(x.float(), None, weight, 1e-6)[0]  # fp32 input, fp64 weight
    assert torch.equal(mixed, reference.add_rms_norm(x.float(), None, weight, 1e-6)[0])
    fp8 = torch.zeros(2, 4, 2, 1, 8, dtype=torch.float8_e4m3fn)
    cpu_fused.store_kv_cache(torch.ones(1, 1, 8), torch.ones(1, 1, 8), fp8, torch.tensor([3]))
    assert fp8[0, 1, 1].float().eq(1).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_greedy_tokens_are_the_same_through_either_set_of_ops(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """The whole engine (chunked prefills beside decodes): the C ops against the torch twins, token for token."""
    from mmserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 40)]
    tokens = {}
    for name in ("torch", "cpu"):
        monkeypatch.setenv("MMSERVE_ELEMENTWISE_BACKEND", name)
        assert dispatch.get_elementwise_ops(torch.device("cpu")).name == name  # what the runner will take
        llm = LLM(str(tiny_model_dir("qwen2")), dtype=dtype, max_num_batched_tokens=32, max_step_ms=0)
        tokens[name] = [o.token_ids for o in llm.generate(prompts, params)]
    assert tokens["cpu"] == tokens["torch"]


def _ops_in_a_fresh_process(cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    code = "import torch\nfrom mmserve.kernels import dispatch\nprint(dispatch.get_elementwise_ops(torch.device('cpu')).name)\n"
    return python_with_kernel_cache(code, cache, "MMSERVE_ELEMENTWISE_BACKEND", **env)


def test_built_once_per_machine_and_without_a_compiler_the_twins(tmp_path: Path) -> None:
    """A second start loads the cached library (no recompilation, whatever the batch sizes later: the kernels
    take sizes as arguments); with no compiler the torch twins run, and forcing the C ops is an error."""
    assert _ops_in_a_fresh_process(tmp_path / "a").stdout.split() == ["cpu"]
    (library,) = (tmp_path / "a").glob("fused_elementwise-*.so")
    stamp = library.stat().st_mtime_ns
    assert _ops_in_a_fresh_process(tmp_path / "a").stdout.split() == ["cpu"]
    assert library.stat().st_mtime_ns == stamp
    fallback = _ops_in_a_fresh_process(tmp_path / "b", CC="false")
    assert fallback.stdout.split() == ["torch"], fallback.stderr
    forced = _ops_in_a_fresh_process(tmp_path / "b", CC="false", MMSERVE_ELEMENTWISE_BACKEND="cpu")
    assert forced.returncode != 0 and "could not be built" in forced.stderr
    assert dispatch.get_elementwise_ops(torch.device("meta")).name == "torch"
