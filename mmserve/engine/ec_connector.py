"""Encoder disaggregation over a shared directory (vLLM's `--ec-transfer-config` "ECExampleConnector"): an
encoder instance stores each temporal group it encodes as one safetensors file keyed by `mm_hash` and group;
a prefill instance loads a stored group instead of running its vision tower.

Files are written whole, then renamed into place, so a reader sees a complete file or none. The producer keeps
the directory under a byte cap (oldest of its own files first); a group evicted between the scheduler's check
and the runner's load is encoded after all (the runner still has the pixels).
"""

from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

EncoderKey = tuple[str, int]  # (mm_hash, temporal group)
_MM_HASH = re.compile(r"[0-9a-f]{16,128}")
DEFAULT_MAX_BYTES = 8 << 30


class SharedEncoderStore:
    def __init__(self, path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._written: OrderedDict[Path, int] = OrderedDict()  # this process's files, oldest first -> bytes
        self._bytes = 0
        self.num_saved = 0
        self.num_load_failures = 0

    def _file(self, key: EncoderKey) -> Path | None:
        mm_hash, group = key
        if not _MM_HASH.fullmatch(mm_hash) or group < 0:
            return None  # never a path outside the directory
        return self.path / f"{mm_hash}-{group}.safetensors"

    def contains(self, key: EncoderKey) -> bool:
        """Whether an encoder instance has stored this group (the scheduler asks; torch-free)."""
        file = self._file(key)
        return file is not None and file.is_file()

    def save(self, key: EncoderKey, embeds: torch.Tensor) -> None:
        """Store one group's embeddings ([tokens, embed_width], as the encoder cache holds them)."""
        file = self._file(key)
        if file is None:
            return
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        try:
            save_file({"embeds": embeds.detach().contiguous().cpu()}, str(tmp))
            os.replace(tmp, file)
        except OSError as exc:
            logger.error("storing encoder output %s: %s", file.name, exc)
            tmp.unlink(missing_ok=True)
            return
        self.num_saved += 1
        size = file.stat().st_size
        self._bytes += size - self._written.pop(file, 0)
        self._written[file] = size
        while self._bytes > self.max_bytes and len(self._written) > 1:
            old, old_size = self._written.popitem(last=False)
            old.unlink(missing_ok=True)
            self._bytes -= old_size

    def load(self, key: EncoderKey, num_tokens: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """The stored group as [num_tokens, embed_width] on `device` in `dtype`; None if it is gone or does
        not fit (the caller encodes it then)."""
        file = self._file(key)
        if file is None:
            return None
        try:
            embeds = load_file(str(file))["embeds"]
        except (OSError, KeyError, SafetensorError) as exc:
            logger.warning("encoder output %s could not be loaded (%s): encoding it here", file.name, exc)
            self.num_load_failures += 1
            return None
        if embeds.dim() != 2 or embeds.shape[0] != num_tokens:
            logger.warning("encoder output %s has shape %s, not [%d, ...]: encoding it here", file.name,
                           tuple(embeds.shape), num_tokens)  # fmt: skip
            self.num_load_failures += 1
            return None
        return embeds.to(device=device, dtype=dtype)
