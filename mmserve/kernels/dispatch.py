"""Chooses the attention backend once at start-up. `MMSERVE_ATTENTION_BACKEND=torch|triton` overrides
the default (triton on CUDA, torch elsewhere)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mmserve.kernels import reference

BACKENDS = ("torch",)


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


def get_attention_backend(device: torch.device) -> AttentionBackend:
    name = os.environ.get("MMSERVE_ATTENTION_BACKEND", "torch").strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"MMSERVE_ATTENTION_BACKEND={name!r} is not available; choose from {BACKENDS}")
    return AttentionBackend("torch", reference.store_kv_cache, reference.paged_attention)
