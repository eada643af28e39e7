"""The step's integer inputs in persistent buffers: one host write and (off the CPU) one device copy a step, and
the tensors each layout of them takes made once and kept.

Why: after a forward has streamed the weights through the caches, every torch call costs its code's cache misses
once more, which at one stream outweighs the work of these few elements. A decode step of an unchanged batch
repeats the layout of the step before it (the same segment lengths), so it makes no torch call here beyond the
device copy: a numpy write of the values into the host buffer, and the views already made.

Invariant: the tensors returned for a step are valid until the next `write`; the runner is done with a step's
inputs before it prepares the next one (each step ends with the host sync of its sampled tokens)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import numpy as np
import torch

Layout = TypeVar("Layout", bound=Hashable)
Views = TypeVar("Views")

_MAX_LAYOUTS = 256  # the cache of layouts is emptied past this; a prefill step's layout seldom repeats


class StepInputBuffer(Generic[Layout, Views]):
    """int64 buffers of at least `capacity` elements: on the host, and on `device` when that is not the CPU (on
    the CPU the two are one). `make_views(layout, device_part, host_part)` builds a layout's tensors from the two
    written parts."""

    def __init__(
        self, device: torch.device, make_views: Callable[[Layout, torch.Tensor, torch.Tensor], Views], capacity: int = 4096
    ) -> None:
        self.device = device
        self._make_views = make_views
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self._host = torch.zeros(capacity, dtype=torch.int64)
        self._array: np.ndarray = self._host.numpy()  # shares the host buffer's memory
        on_host = self.device.type == "cpu"
        self._device = self._host if on_host else torch.zeros(capacity, dtype=torch.int64, device=self.device)
        # layout -> (number of values, host source of the device copy (None on the CPU), its target, the views)
        self._layouts: dict[Layout, tuple[int, torch.Tensor | None, torch.Tensor, Views]] = {}

    @property
    def capacity(self) -> int:
        return len(self._array)

    @property
    def num_layouts(self) -> int:
        return len(self._layouts)

    def write(self, values: list[int], num_device: int, layout: Layout) -> Views:
        """Writes `values`: the first `num_device` for the device, the rest for the host only. `layout` names the
        segment lengths the views cut (equal layouts: equal lengths, so equal views). Returns the layout's
        views, valid until the next write."""
        count = len(values)
        if count > self.capacity:  # every layout's views are of the old buffers: all go
            self._allocate(max(count, 2 * self.capacity))
        self._array[:count] = values
        entry = self._layouts.get(layout)
        if entry is None:
            if len(self._layouts) >= _MAX_LAYOUTS:
                self._layouts.clear()
            target = self._device[:num_device]
            source = None if self._device is self._host else self._host[:num_device]
            views = self._make_views(layout, target, self._host[num_device:count])
            entry = self._layouts[layout] = (count, source, target, views)
        elif entry[0] != count:
            raise ValueError(f"layout {layout!r} was {entry[0]} values, now {count}")
        _, source, target, views = entry
        if source is not None:  # pageable host memory: the copy has read it when it returns
            target.copy_(source)
        return views
