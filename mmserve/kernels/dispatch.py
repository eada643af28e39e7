"""Chooses the attention backend once at start-up: triton on CUDA, torch elsewhere;
`MMSERVE_ATTENTION_BACKEND=torch|triton` overrides. Triton is imported only when chosen."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmserve.kernels import reference

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


def get_attention_backend(device: torch.device) -> AttentionBackend:
    name = os.environ.get("MMSERVE_ATTENTION_BACKEND", "").strip().lower() or default_backend(device)
    if name not in BACKENDS:
        raise ValueError(f"MMSERVE_ATTENTION_BACKEND={name!r} is not available; choose from {BACKENDS}")
    if name == "triton":
        return _triton_backend(device)
    return AttentionBackend("torch", reference.store_kv_cache, reference.paged_attention)


def default_backend(device: torch.device) -> str:
    on_cuda = torch.device(device).type == "cuda"
    return "triton" if on_cuda and importlib.util.find_spec("triton") is not None else "torch"


def _triton_backend(device: torch.device) -> AttentionBackend:
    if importlib.util.find_spec("triton") is None:
        raise ValueError("MMSERVE_ATTENTION_BACKEND=triton, but triton is not installed")
    from mmserve.kernels import triton_attention, triton_cache

    # Triton picks compiled or interpreted kernels when they are decorated, i.e. at the import above.
    if not triton_attention.CONSISTENT or triton_cache.INTERPRETED != triton_attention.INTERPRETED:
        raise ValueError(
            "TRITON_INTERPRET changed between the first `import triton` and the import of mmserve's "
            "triton kernels; set it (or not) before anything imports triton"
        )
    if torch.device(device).type != "cuda" and not triton_attention.INTERPRETED:
        raise ValueError(
            "MMSERVE_ATTENTION_BACKEND=triton on a non-CUDA device needs TRITON_INTERPRET=1 in the "
            "environment before triton is first imported (the kernels then run in Triton's interpreter)"
        )
    return AttentionBackend("triton", triton_cache.store_kv_cache, triton_attention.paged_attention)
