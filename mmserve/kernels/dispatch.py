"""Chooses the attention backend once at start-up: triton on CUDA; on the CPU the C decode kernel
(`cpu`) where it compiles, else the torch reference (`torch`). `MMSERVE_ATTENTION_BACKEND=torch|cpu|triton`
overrides. Triton is imported only when chosen. `get_moe_backend` picks the MoE experts the same way
(`MMSERVE_MOE_BACKEND=torch|triton`: triton on CUDA, the torch reference otherwise), and `get_w4a16_backend` the
int4-weight linear layers' kernel (`MMSERVE_W4A16_BACKEND=torch|triton`, likewise), and
`get_elementwise_ops` the decoder's fused elementwise steps (`MMSERVE_ELEMENTWISE_BACKEND=torch|cpu`: the C
kernels on the CPU where they compile, the torch twins otherwise)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmserve.kernels import cpu_attention, cpu_fused, moe, quant, reference
from mmserve.kernels.launch_plan import LaunchPlan

BACKENDS = ("torch", "cpu", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # (block_tables, decode seqs, their seq_lens, their rows) -> the step's attention metadata (ForwardBatch's),
    # built once per step by the runner from reference.decode_row_values it wrote to the host:
    # reference.decode_rows_of for torch and cpu; None for triton, whose per-step plan is cached on the host lists
    # in the first layer's call
    step_metadata: Callable[..., reference.DecodeRows] | None = None
    # (query_start_loc, seq_lens, num_heads, num_kv_heads, max_seq_len) -> the metadata of a pure-decode batch
    # over static device buffers, which a captured graph replays (`engine/decode_graphs.py`); None: this
    # backend's attention reads host lists, so its decodes cannot be captured
    decode_graph_metadata: Callable[..., LaunchPlan] | None = None


def _chosen(variable: str, default: str, choices: tuple[str, ...]) -> str:
    """The backend the environment variable names, else `default`; a name not in `choices` is an error."""
    name = os.environ.get(variable, "").strip().lower() or default
    if name not in choices:
        raise ValueError(f"{variable}={name!r} is not available; choose from {choices}")
    return name


def _require_triton(variable: str) -> None:
    if importlib.util.find_spec("triton") is None:
        raise ValueError(f"{variable}=triton, but triton is not installed")


def _check_triton_kernels(variable: str, device: torch.device, consistent: bool, interpreted: bool) -> None:
    """Triton picks compiled or interpreted kernels when they are decorated, i.e. when their module is first
    imported: they must agree with the `import triton` before them, and off CUDA they must be interpreted."""
    if not consistent:
        raise ValueError(
            "TRITON_INTERPRET changed between the first `import triton` and the import of mmserve's "
            "triton kernels; set it (or not) before anything imports triton"
        )
    if torch.device(device).type != "cuda" and not interpreted:
        raise ValueError(
            f"{variable}=triton on a non-CUDA device needs TRITON_INTERPRET=1 in the environment before "
            "triton is first imported (the kernels then run in Triton's interpreter)"
        )


def get_attention_backend(device: torch.device) -> AttentionBackend:
    name = _chosen("MMSERVE_ATTENTION_BACKEND", default_backend(device), BACKENDS)
    if name == "triton":
        return _triton_backend(device)
    if name == "cpu":
        if cpu_attention.load() is None:
            raise ValueError(
                "MMSERVE_ATTENTION_BACKEND=cpu, but the C kernel could not be built (see the log)"
            )
        return AttentionBackend("cpu", cpu_fused.store_kv_cache, cpu_attention.paged_attention, reference.decode_rows_of)
    return AttentionBackend("torch", reference.store_kv_cache, reference.paged_attention, reference.decode_rows_of)


def default_backend(device: torch.device) -> str:
    device_type = torch.device(device).type
    if device_type == "cuda":
        return "triton" if importlib.util.find_spec("triton") is not None else "torch"
    return "cpu" if device_type == "cpu" and cpu_attention.load() is not None else "torch"


def _triton_backend(device: torch.device) -> AttentionBackend:
    _require_triton("MMSERVE_ATTENTION_BACKEND")
    from mmserve.kernels import triton_attention, triton_cache

    consistent = triton_attention.CONSISTENT and triton_cache.INTERPRETED == triton_attention.INTERPRETED
    _check_triton_kernels("MMSERVE_ATTENTION_BACKEND", device, consistent, triton_attention.INTERPRETED)
    return AttentionBackend("triton", triton_cache.store_kv_cache, triton_attention.paged_attention,
                            decode_graph_metadata=triton_attention.decode_graph_plan)  # fmt: skip


MOE_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class MoEBackend:
    name: str
    fused_moe: Callable[..., torch.Tensor]


def get_moe_backend(device: torch.device) -> MoEBackend:
    name = _chosen("MMSERVE_MOE_BACKEND", default_moe_backend(device), MOE_BACKENDS)
    if name == "triton":
        return _triton_moe_backend(device)
    return MoEBackend("torch", moe.fused_moe)


def default_moe_backend(device: torch.device) -> str:
    """triton on CUDA where it is installed, else torch: also the int4-weight linear layers' default."""
    on_cuda = torch.device(device).type == "cuda"
    return "triton" if on_cuda and importlib.util.find_spec("triton") is not None else "torch"


def _triton_moe_backend(device: torch.device) -> MoEBackend:
    _require_triton("MMSERVE_MOE_BACKEND")
    from mmserve.kernels import triton_moe

    _check_triton_kernels("MMSERVE_MOE_BACKEND", device, triton_moe.CONSISTENT, triton_moe.INTERPRETED)
    return MoEBackend("triton", triton_moe.fused_moe)


W4A16_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class W4A16Backend:
    name: str
    w4a16_linear: Callable[..., torch.Tensor]  # quant.w4a16_linear's signature


def get_w4a16_backend(device: torch.device) -> W4A16Backend:
    name = _chosen("MMSERVE_W4A16_BACKEND", default_moe_backend(device), W4A16_BACKENDS)
    if name == "triton":
        _require_triton("MMSERVE_W4A16_BACKEND")
        from mmserve.kernels import triton_w4a16

        _check_triton_kernels("MMSERVE_W4A16_BACKEND", device, triton_w4a16.CONSISTENT, triton_w4a16.INTERPRETED)
        return W4A16Backend("triton", triton_w4a16.w4a16_linear)
    return W4A16Backend("torch", quant.w4a16_linear)


ELEMENTWISE_BACKENDS = ("torch", "cpu")


@dataclass(frozen=True)
class ElementwiseOps:
    """The decoder's elementwise steps; each has reference.py's signature of the same name."""

    name: str
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    rotary_qk: Callable[..., tuple[torch.Tensor, torch.Tensor]]


TORCH_ELEMENTWISE = ElementwiseOps("torch", reference.add_rms_norm, reference.silu_and_mul, reference.rotary_qk)


def get_elementwise_ops(device: torch.device) -> ElementwiseOps:
    on_cpu = torch.device(device).type == "cpu"
    name = _chosen("MMSERVE_ELEMENTWISE_BACKEND", "cpu" if on_cpu and cpu_fused.load() else "torch", ELEMENTWISE_BACKENDS)
    if name == "torch":
        return TORCH_ELEMENTWISE
    if not cpu_fused.load():
        raise ValueError("MMSERVE_ELEMENTWISE_BACKEND=cpu, but the C kernels could not be built (see the log)")
    return ElementwiseOps("cpu", cpu_fused.add_rms_norm, cpu_fused.silu_and_mul, cpu_fused.rotary_qk)
