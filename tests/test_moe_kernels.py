"""The MoE kernels: routing and the torch reference against transformers' Qwen3-MoE modules, the expert
alignment's invariants, the Triton kernel against the reference (in Triton's interpreter without CUDA: tiny
shapes) and the backend choice."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _kernels_runnable_here() -> bool:
    """As in test_triton_kernels: natively on CUDA, else in Triton's interpreter, which needs
    TRITON_INTERPRET=1 before the first `import triton` (transformers imports it, so this runs first)."""
    if not HAS_TRITON:
        return False
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    from mmserve.kernels import triton_moe

    return triton_moe.CONSISTENT and (triton_moe.INTERPRETED or torch.cuda.is_available())


IN_PROCESS = _kernels_runnable_here()

from transformers import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import (  # noqa: E402
    Qwen3MoeExperts,
    Qwen3MoeTopKRouter,
)

from mmserve.kernels import moe  # noqa: E402
from mmserve.kernels.dispatch import default_moe_backend, get_moe_backend  # noqa: E402

if IN_PROCESS:
    from mmserve.kernels import triton_moe

triton_here = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton missing, or imported compiled: run by test_triton_moe_in_a_fresh_interpreter_process",
)
DEVICE = torch.device("cuda" if IN_PROCESS and not triton_moe.INTERPRETED else "cpu")
# The interpreter's bf16 tl.dot is wrong (the kernel casts to fp32 there): bf16 is checked natively only.
TRITON_DTYPES = [torch.float32, torch.float16] + ([] if DEVICE.type == "cpu" else [torch.bfloat16])
TOLERANCE = {torch.float32: 1e-5 if DEVICE.type == "cpu" else 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
HIDDEN, INTERMEDIATE = 48, 32


def make_experts(
    num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_gate_up [num_experts, 2 * intermediate, hidden], w_down [num_experts, hidden, intermediate])."""
    gen = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * hidden**-0.5
    w_down = torch.randn(num_experts, hidden, intermediate, generator=gen) * intermediate**-0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def route(
    num_tokens: int, num_experts: int, top_k: int, hidden: int, dtype: torch.dtype, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [num_tokens, hidden], topk_weights [num_tokens, top_k], topk_ids [num_tokens, top_k])."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(dtype)
    weights, ids = moe.select_experts(logits, top_k, renormalize=True)
    return x, weights, ids


def hf_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> Qwen3MoeExperts:
    num_experts, two_i, hidden = w_gate_up.shape
    config = Qwen3MoeConfig(
        num_experts=num_experts, moe_intermediate_size=two_i // 2, hidden_size=hidden, hidden_act="silu"
    )
    experts = Qwen3MoeExperts(config).to(w_gate_up.dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w_gate_up)
        experts.down_proj.copy_(w_down)
    return experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_matches_the_qwen3_moe_router(dtype: torch.dtype, renormalize: bool) -> None:
    config = Qwen3MoeConfig(num_experts=16, num_experts_per_tok=4, norm_topk_prob=renormalize, hidden_size=32)
    router = Qwen3MoeTopKRouter(config).to(dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen))
        logits, scores, indices = router(torch.randn(9, 32, generator=gen).to(dtype))
    weights, ids = moe.select_experts(logits, 4, renormalize)
    assert weights.dtype == dtype and ids.dtype == torch.int64
    assert torch.equal(ids, indices) and torch.equal(weights, scores)


# (num_experts, top_k): one expert, top_k == experts, and 64 experts where most get no rows at few tokens.
EXPERT_CASES = [(1, 1), (4, 1), (4, 2), (16, 1), (16, 2), (16, 8), (64, 1), (64, 2), (64, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_experts", "top_k"), EXPERT_CASES)
def test_reference_matches_qwen3_moe_experts(num_experts: int, top_k: int, dtype: torch.dtype) -> None:
    """Both GEMM strategies; on this CPU they match transformers to the bit, the tolerance is for others."""
    w_gate_up, w_down = make_experts(num_experts, HIDDEN, INTERMEDIATE, dtype)
    experts = hf_experts(w_gate_up, w_down)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    for num_tokens in (1, 3, 17, 130):
        x, weights, ids = route(num_tokens, num_experts, top_k, HIDDEN, dtype, seed=num_tokens)
        with torch.no_grad():
            expected = experts(x, ids, weights)
        for grouped in (True, False):
            out = moe.fused_moe_with(x, w_gate_up, w_down, weights, ids, grouped=grouped)
            assert out.shape == x.shape and out.dtype == dtype
            torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    assert moe.fused_moe(x, w_gate_up, w_down, weights, ids).shape == x.shape


@pytest.mark.parametrize(
    ("num_experts", "top_k", "block_m"), [(1, 1, 16), (8, 2, 4), (64, 8, 16), (4, 4, 16)]
)
def test_moe_align_pads_each_expert_to_whole_blocks(num_experts: int, top_k: int, block_m: int) -> None:
    _, _, ids = route(11, num_experts, top_k, 8, torch.float32)
    sorted_ids, block_experts, post_padded = moe.moe_align(ids, num_experts, block_m)
    num_pairs = ids.numel()
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    used = int(post_padded)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.numel() % block_m == 0 and sorted_ids.numel() >= used
    assert sorted_ids.dtype == block_experts.dtype == torch.int32
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    assert (sorted_ids[used:] == num_pairs).all()
    for block in range(used // block_m):
        rows = sorted_ids[block * block_m : (block + 1) * block_m]
        rows = rows[rows < num_pairs].long()
        assert rows.numel() > 0  # no block of padding only: empty experts get no block
        assert (ids.reshape(-1)[rows] == block_experts[block]).all()


def test_reference_without_tokens() -> None:
    w_gate_up, w_down = make_experts(4, HIDDEN, INTERMEDIATE, torch.float32)
    x = torch.empty(0, HIDDEN)
    out = moe.fused_moe(x, w_gate_up, w_down, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64))
    assert out.shape == (0, HIDDEN)


# (num_experts, top_k, num_tokens, hidden, intermediate): a single expert, top_k == experts, 64 experts
# mostly empty, hidden/intermediate not multiples of the K tile, and a batch of many blocks.
TRITON_CASES = [
    (1, 1, 1, 32, 16),
    (4, 4, 9, 48, 48),
    (64, 8, 5, 32, 32),
    (16, 2, 17, 64, 32),
    (8, 2, 130, 32, 16),
]


@triton_here
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize(("num_experts", "top_k", "num_tokens", "hidden", "intermediate"), TRITON_CASES)
def test_triton_moe_matches_reference(
    num_experts: int, top_k: int, num_tokens: int, hidden: int, intermediate: int, dtype: torch.dtype
) -> None:
    if num_tokens > 100 and dtype != torch.float32 and DEVICE.type == "cpu":
        pytest.skip("the interpreter's time goes to the smaller cases")
    w_gate_up, w_down = (w.to(DEVICE) for w in make_experts(num_experts, hidden, intermediate, dtype))
    x, weights, ids = (t.to(DEVICE) for t in route(num_tokens, num_experts, top_k, hidden, dtype))
    out = triton_moe.fused_moe(x, w_gate_up, w_down, weights, ids)
    assert out.shape == x.shape and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, moe.fused_moe(x, w_gate_up, w_down, weights, ids), atol=tol, rtol=tol)


@triton_here
def test_triton_moe_strided_inputs_and_repeated_experts() -> None:
    """Views as a caller may pass them (hidden a slice of a wider tensor, weights transposed in memory, fp32
    routing weights with fp16 activations) and one expert routed twice for a token."""
    num_experts, hidden, intermediate = 4, 32, 16
    w_gate_up, w_down = make_experts(num_experts, hidden, intermediate, torch.float16)
    w_gate_up = w_gate_up.transpose(1, 2).contiguous().transpose(1, 2).to(DEVICE)  # [E, 2I, H], strided
    w_down = w_down.to(DEVICE)
    wide = torch.randn(6, 2 * hidden, generator=torch.Generator().manual_seed(3)).half().to(DEVICE)
    x = wide[:, :hidden]  # [6, hidden], row stride 2 * hidden
    ids = torch.tensor([[0, 0], [3, 1], [2, 2], [1, 3], [3, 3], [0, 2]], device=DEVICE)
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert not x.is_contiguous() and not w_gate_up.is_contiguous()
    expected = moe.fused_moe(x, w_gate_up, w_down, weights, ids)
    tol = TOLERANCE[torch.float16]
    torch.testing.assert_close(
        triton_moe.fused_moe(x, w_gate_up, w_down, weights, ids), expected, atol=tol, rtol=tol
    )


@triton_here
def test_triton_moe_without_tokens() -> None:
    w_gate_up, w_down = (w.to(DEVICE) for w in make_experts(4, HIDDEN, INTERMEDIATE, torch.float32))
    x = torch.empty(0, HIDDEN, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    assert triton_moe.fused_moe(x, w_gate_up, w_down, torch.empty(0, 2, device=DEVICE), ids).shape == x.shape


def test_moe_dispatch_defaults_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MMSERVE_MOE_BACKEND", raising=False)
    backend = get_moe_backend(torch.device("cpu"))
    assert backend.name == "torch" and backend.fused_moe is moe.fused_moe
    assert default_moe_backend(torch.device("cuda")) == ("triton" if HAS_TRITON else "torch")
    monkeypatch.setenv("MMSERVE_MOE_BACKEND", "torch")
    assert get_moe_backend(torch.device("cuda")).fused_moe is moe.fused_moe
    monkeypatch.setenv("MMSERVE_MOE_BACKEND", "deepgemm")
    with pytest.raises(ValueError, match="not available"):
        get_moe_backend(torch.device("cpu"))


@triton_here
def test_triton_moe_dispatch_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_MOE_BACKEND", "triton")
    backend = get_moe_backend(DEVICE)
    assert backend.name == "triton" and backend.fused_moe is triton_moe.fused_moe


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_moe_dispatch_refuses_compiled_triton_on_the_cpu() -> None:
    """A process that imported triton without TRITON_INTERPRET cannot run it on CPU tensors."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["MMSERVE_MOE_BACKEND"] = "triton"
    code = (
        "import torch\nfrom mmserve.kernels.dispatch import get_moe_backend\n"
        "try:\n    get_moe_backend(torch.device('cpu'))\nexcept ValueError as e:\n    print('refused:', e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "TRITON_INTERPRET=1" in done.stdout


@pytest.mark.skipif(IN_PROCESS or not HAS_TRITON, reason="the Triton kernel runs in this process")
def test_triton_moe_in_a_fresh_interpreter_process() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton_moe and not fresh"]
    done = subprocess.run(
        [*cmd, str(Path(__file__).resolve())],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout
