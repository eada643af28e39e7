"""Turns a prompt's media into what the engine core needs: decoded and preprocessed pixels, each
placeholder expanded to its exact number of embedding tokens, `mm_hash`es, and M-RoPE positions.

Knows the checkpoint's placeholder tokens and preprocessing; knows nothing of scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from mmserve.encoders.decode_pool import DecodePool
from mmserve.encoders.media import DEFAULT_LIMITS, MediaLimits, check_items_per_prompt
from mmserve.encoders.positions import MediaSpan, mrope_positions
from mmserve.encoders.preprocess import load_preprocess_configs, mm_hash, preprocess_image, preprocess_video
from mmserve.encoders.vision import EncoderInput
from mmserve.errors import InvalidRequestError
from mmserve.request import MultiModalInput, PlaceholderRange


@dataclass(frozen=True, eq=False)
class ExpandedPrompt:
    token_ids: list[int]  # placeholders expanded
    mm_inputs: list[MultiModalInput]  # in prompt order
    mrope_positions: torch.Tensor  # [3, len(token_ids)]
    mrope_delta: int


class MultiModalProcessor:
    def __init__(
        self, model_dir: str | Path, hf_config: PretrainedConfig, limits: MediaLimits = DEFAULT_LIMITS
    ) -> None:
        self.limits = limits
        # Untrusted bytes are decoded in worker processes (spawned on first use, or by the server at start).
        self.decoder = DecodePool.for_limits(limits)
        self.image_config, self.video_config = load_preprocess_configs(model_dir)
        self.image_token_id: int = hf_config.image_token_id
        self.video_token_id: int = hf_config.video_token_id
        vision = hf_config.vision_config
        self.merge_size: int = vision.spatial_merge_size
        # Qwen2.5-VL spaces video groups in time: tokens_per_second * seconds per group; Qwen2-VL by 1.
        self.tokens_per_second: float | None = getattr(vision, "tokens_per_second", None)

    def has_placeholders(self, token_ids: Sequence[int]) -> bool:
        return self.image_token_id in token_ids or self.video_token_id in token_ids

    def expand(
        self, token_ids: Sequence[int], images: Sequence[object], videos: Sequence[object]
    ) -> ExpandedPrompt:
        check_items_per_prompt(len(images) + len(videos), self.limits, param="prompt")
        slots = [(i, t) for i, t in enumerate(token_ids) if t in (self.image_token_id, self.video_token_id)]
        num_image_slots = sum(1 for _, t in slots if t == self.image_token_id)
        if num_image_slots != len(images) or len(slots) - num_image_slots != len(videos):
            raise InvalidRequestError(
                f"prompt: it holds {num_image_slots} image and {len(slots) - num_image_slots} video placeholders "
                f"for {len(images)} images and {len(videos)} videos; there must be exactly one per item",
                param="prompt",
            )
        image_iter, video_iter = iter(enumerate(images)), iter(enumerate(videos))
        expanded: list[int] = []
        mm_inputs: list[MultiModalInput] = []
        spans: list[MediaSpan] = []
        cursor = 0
        for index, token in slots:
            expanded.extend(token_ids[cursor:index])
            if token == self.image_token_id:
                n, source = next(image_iter)
                mm, span = self._image(source, f"image {n}", len(expanded))
            else:
                n, source = next(video_iter)
                mm, span = self._video(source, f"video {n}", len(expanded))
            expanded.extend([token] * mm.placeholder.length)
            mm_inputs.append(mm)
            spans.append(span)
            cursor = index + 1
        expanded.extend(token_ids[cursor:])
        positions, delta = mrope_positions(len(expanded), spans, self.merge_size)
        return ExpandedPrompt(expanded, mm_inputs, positions, delta)

    def _image(self, source: object, item: str, offset: int) -> tuple[MultiModalInput, MediaSpan]:
        image = self.decoder.load_image(source, self.limits, item=item, param="images")
        processed = preprocess_image(image, self.image_config, item=item)
        placeholder = PlaceholderRange(offset, processed.num_embeds)
        data = EncoderInput(processed.pixel_values, processed.grid_thw)
        mm = MultiModalInput(mm_hash(image, self.image_config), placeholder, "image", 1, data)
        return mm, MediaSpan(offset, processed.num_embeds, processed.grid_thw)

    def _video(self, source: object, item: str, offset: int) -> tuple[MultiModalInput, MediaSpan]:
        video = self.decoder.load_video(source, self.limits, item=item, param="videos")
        processed = preprocess_video(video.frames, self.video_config, item=item)
        placeholder = PlaceholderRange(offset, processed.num_embeds)
        data = EncoderInput(processed.pixel_values, processed.grid_thw)
        digest = mm_hash(video.frames, self.video_config, fps=video.fps)
        mm = MultiModalInput(digest, placeholder, "video", processed.grid_thw[0], data)
        interval = 1.0
        if self.tokens_per_second is not None:
            interval = self.tokens_per_second * self.video_config.temporal_patch_size / video.fps
        return mm, MediaSpan(offset, processed.num_embeds, processed.grid_thw, interval)
