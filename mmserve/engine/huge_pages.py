"""A CPU model's parameters in one region of transparent huge pages. A decode step streams every weight once;
on 4 KiB pages that is a TLB miss (a page walk) every 4 KiB, and where torch allocates them the weights land on
4 KiB pages (THP in "madvise" mode, the common default, gives huge pages only to regions that ask). One
anonymous private mapping advised MADV_HUGEPAGE, the parameters copied in and rebound to views of it: on a Zen 3
the few-row C product over the bench weights ran 1.2x faster (docs/benchmarks.md). Linux only; elsewhere, with
THP off, or with MMSERVE_CPU_HUGE_PAGES=0, the parameters stay where they are (only slower)."""

from __future__ import annotations

import logging
import mmap
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

ENV = "MMSERVE_CPU_HUGE_PAGES"  # 0: leave the parameters where torch allocated them
_ALIGN = 4096  # each parameter starts on a page (the C kernels' vector loads want at least 64 bytes)


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def move_to_huge_pages(module: nn.Module) -> mmap.mmap | None:
    """Rebinds every CPU parameter of `module` (a tied one once) to a view of one MADV_HUGEPAGE region, values
    unchanged; returns the region, which must outlive the parameters (the caller keeps it), or None where the
    parameters stay (not Linux, no parameters on the CPU, $MMSERVE_CPU_HUGE_PAGES=0, or the advice refused)."""
    params = list({id(p): p for p in module.parameters() if p.device.type == "cpu"}.values())
    if not params or not enabled() or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    sizes = [-(-p.numel() * p.element_size() // _ALIGN) * _ALIGN for p in params]
    region = mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # THP compiled out: nothing to gain from the copy
        logger.info("weights stay on 4 KiB pages: %s", exc)
        region.close()
        return None
    flat = torch.frombuffer(region, dtype=torch.uint8)  # [bytes]: shares the region's memory
    offset = 0
    with torch.no_grad():
        for p, size in zip(params, sizes, strict=True):
            view = flat[offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
            offset += size
    return region
