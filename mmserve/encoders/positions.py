"""M-RoPE positions of a media prompt, equal to transformers' `get_rope_index` for Qwen2-VL,
Qwen2.5-VL and Qwen3-VL: text runs count up by one; a media item's tokens take (t, h, w) grid positions
from where the text stopped; decoding continues from the largest position used plus one. (Qwen3-VL
splits a video into one span per temporal group, grid (1, h, w), with its timestamp text between.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MediaSpan:
    offset: int  # first placeholder token in the prompt
    length: int  # embedding tokens = t * h * w / merge**2
    grid_thw: tuple[int, int, int]  # patch grid before the spatial merge
    time_interval: float = (
        1.0  # temporal position step per group (Qwen2.5-VL videos: tokens_per_second * s/group)
    )


def mrope_positions(
    num_tokens: int, spans: Sequence[MediaSpan], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """Returns positions [3, num_tokens] (int64) and the delta: output token i sits at i + delta."""
    parts = []
    current = 0  # next text position
    cursor = 0  # next prompt index
    for span in sorted(spans, key=lambda s: s.offset):
        text_len = span.offset - cursor
        parts.append(torch.arange(current, current + text_len).expand(3, -1))
        current += text_len
        t, h, w = (
            span.grid_thw[0],
            span.grid_thw[1] // spatial_merge_size,
            span.grid_thw[2] // spatial_merge_size,
        )
        if t * h * w != span.length:
            raise ValueError(f"a grid of {span.grid_thw} gives {t * h * w} tokens, not {span.length}")
        tt = (torch.arange(t) * span.time_interval).long() + current
        hh = torch.arange(h) + current
        ww = torch.arange(w) + current
        grid = torch.stack(torch.meshgrid(tt, hh, ww, indexing="ij")).reshape(3, -1)
        parts.append(grid)
        # transformers advances by the spatial extent only, even for videos; matched as it is.
        current += max(h, w)
        cursor = span.offset + span.length
    parts.append(torch.arange(current, current + num_tokens - cursor).expand(3, -1))
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - num_tokens
