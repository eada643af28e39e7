"""Turns a prompt's media into what the engine core needs: decoded and preprocessed pixels, each
placeholder expanded to its exact number of embedding tokens, `mm_hash`es, and M-RoPE positions.

Qwen3-VL videos: the single video placeholder becomes, per temporal group g, the text "<t_g seconds>"
(tokenized), <|vision_start|>, the group's placeholders, <|vision_end|> (transformers'
`Qwen3VLProcessor.replace_video_token`); each group is its own `MultiModalInput` and `MediaSpan` with
grid (1, h, w), which is how `Qwen3VLModel.get_rope_index` positions it.

Knows the checkpoint's placeholder tokens and preprocessing; knows nothing of scheduling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig

from mmserve.encoders.decode_pool import DecodePool
from mmserve.encoders.media import DEFAULT_LIMITS, MediaLimits, check_items_per_prompt
from mmserve.encoders.positions import MediaSpan, mrope_positions
from mmserve.encoders.preprocess import (
    ProcessedVideo,
    load_preprocess_configs,
    mm_hash,
    num_embeds,
    preprocess_image,
    preprocess_video,
    resized_size,
)
from mmserve.encoders.vision import EncoderInput
from mmserve.errors import InvalidRequestError, PromptTooLongError
from mmserve.request import MultiModalInput, PlaceholderRange


@dataclass(frozen=True, eq=False)
class ExpandedPrompt:
    token_ids: list[int]  # placeholders expanded
    mm_inputs: list[MultiModalInput]  # in prompt order
    mrope_positions: torch.Tensor  # [3, len(token_ids)]
    mrope_delta: int


QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe")


def frame_group_timestamps(timestamps_s: Sequence[float], temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal group: the frame times padded to a multiple of the temporal patch by
    repeating the last, then the mean of each patch's first and last (transformers' `_calculate_timestamps`,
    with real presentation times in place of frame_index / fps)."""
    times = list(timestamps_s)
    if pad := -len(times) % temporal_patch_size:
        times += [times[-1]] * pad
    tp = temporal_patch_size
    return [(times[i] + times[i + tp - 1]) / 2 for i in range(0, len(times), tp)]


class MultiModalProcessor:
    def __init__(
        self,
        model_dir: str | Path,
        hf_config: PretrainedConfig,
        limits: MediaLimits = DEFAULT_LIMITS,
        encode: Callable[[str], list[int]] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """`encode`: the checkpoint tokenizer's text -> ids without special tokens (Qwen3-VL's video
        timestamps need it). `max_model_len`: a video whose tokens cannot fit is refused before it is
        preprocessed (None: only the `Processor`'s check after expansion)."""
        self.limits = limits
        self.max_model_len = max_model_len
        # Untrusted bytes are decoded in worker processes (spawned on first use, or by the server at start).
        self.decoder = DecodePool.for_limits(limits)
        # A checkpoint without video settings gets its family's video defaults, not the image bounds.
        self.image_config, self.video_config = load_preprocess_configs(model_dir, hf_config.model_type)
        self.image_token_id: int = hf_config.image_token_id
        self.video_token_id: int = hf_config.video_token_id
        vision = hf_config.vision_config
        self.merge_size: int = vision.spatial_merge_size
        # Qwen2.5-VL spaces video groups in time: tokens_per_second * seconds per group; Qwen2-VL by 1.
        self.tokens_per_second: float | None = getattr(vision, "tokens_per_second", None)
        self.timestamped_videos = hf_config.model_type in QWEN3_VL_TYPES
        self.video_limits = limits
        if self.timestamped_videos:
            if encode is None:
                raise ValueError("Qwen3-VL video prompts need the tokenizer's encode function for timestamps")
            self.encode = encode
            self.vision_start_id: int = hf_config.vision_start_token_id
            self.vision_end_id: int = hf_config.vision_end_token_id
            # Sample files at the checkpoint's own rate and frame cap, within the server's limits (an operator's
            # lower rate wins).
            cfg = self.video_config
            self.video_limits = dataclasses.replace(
                limits,
                video_fps=min(cfg.fps, limits.video_fps) if cfg.fps else limits.video_fps,
                max_video_frames=min(limits.max_video_frames, cfg.max_frames or limits.max_video_frames),
            )

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
                expanded.extend([token] * mm.placeholder.length)
                mm_inputs.append(mm)
                spans.append(span)
            else:
                n, source = next(video_iter)
                # At least this many prompt tokens are not this video's: all before it, as expanded, and
                # what follows it (later placeholders counted as one token).
                others = len(expanded) + len(token_ids) - index - 1
                tokens, items = self._video(source, f"video {n}", len(expanded), others)
                expanded.extend(tokens)
                for mm, span in items:
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

    def _video(
        self, source: object, item: str, offset: int, others: int
    ) -> tuple[list[int], list[tuple[MultiModalInput, MediaSpan]]]:
        """The video's prompt tokens (its placeholder expanded) and its inputs with their spans. `others`:
        prompt tokens besides this video's."""
        cfg = self.video_config
        limits = self.limits if isinstance(source, np.ndarray) else self.video_limits  # arrays: as given
        # From the container's headers: the frames' count and size, so the token count and the resized size
        # are known before any frame is decoded; each frame is then resized right after its decoding.
        plan = self.decoder.plan_video(source, limits, item=item, param="videos")
        few = cfg.min_frames is not None and plan.num_frames < cfg.min_frames
        if self.timestamped_videos and few and plan.duration_s > 0 and not isinstance(source, np.ndarray):
            # Qwen3VLVideoProcessor samples at least min_frames (never more than the source has): a short
            # clip is sampled faster.
            fps = max(limits.video_fps, cfg.min_frames / plan.duration_s)  # type: ignore[operator]
            limits = dataclasses.replace(limits, video_fps=fps)
            plan = self.decoder.plan_video(source, limits, item=item, param="videos")
        size = self._resized(item, plan.num_frames, plan.height, plan.width)
        times = plan.timestamps_s or tuple(k / plan.fps for k in range(plan.num_frames))  # files: nominal
        self._check_fits(item, self._length(plan.num_frames, size, times), others)
        video = self.decoder.load_video(
            source, limits, item=item, param="videos", resize_to=size, resample=cfg.resample
        )
        processed = preprocess_video(video.frames, cfg, item=item, size=size)
        if self.timestamped_videos:
            stamps = frame_group_timestamps(video.timestamps_s, cfg.temporal_patch_size)
            stamp_ids = [self.encode(f"<{t:.1f} seconds>") for t in stamps]
            return self._timestamped_video(video.frames, video.fps, processed, stamp_ids, offset)
        mm, span = self._whole_video(video.frames, video.fps, processed, offset)
        return [self.video_token_id] * mm.placeholder.length, [(mm, span)]

    def _resized(self, item: str, num_frames: int, height: int, width: int) -> tuple[int, int]:
        try:
            return resized_size(height, width, self.video_config, num_frames)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{item}: {exc}", param="videos") from exc

    def _length(self, num_frames: int, size: tuple[int, int], times: Sequence[float]) -> int:
        """Prompt tokens of a video of `num_frames` frames resized to `size`: its embeddings, and for
        Qwen3-VL each group's timestamp text and vision start / end tokens."""
        cfg = self.video_config
        grid = (-(-num_frames // cfg.temporal_patch_size), size[0] // cfg.patch_size, size[1] // cfg.patch_size)
        length = num_embeds(grid, self.merge_size)
        if self.timestamped_videos:
            stamps = frame_group_timestamps(times, cfg.temporal_patch_size)
            length += sum(len(self.encode(f"<{t:.1f} seconds>")) + 2 for t in stamps)
        return length

    def _check_fits(self, item: str, length: int, others: int) -> None:
        if self.max_model_len is not None and others + length >= self.max_model_len:
            raise PromptTooLongError(
                f"{item}: its {length} tokens and the prompt's other {others} leave no room for output "
                f"within max_model_len={self.max_model_len} (send a shorter or lower-resolution video)",
                param="videos",
            )

    def _timestamped_video(
        self, frames: np.ndarray, fps: float, processed: ProcessedVideo, stamp_ids: list[list[int]], offset: int
    ) -> tuple[list[int], list[tuple[MultiModalInput, MediaSpan]]]:
        """Qwen3-VL: per temporal group, "<t seconds>" <|vision_start|> placeholders <|vision_end|>; each group
        its own input (rows of that group only, a view) keyed by the video's hash and the group index."""
        pixel_values, (t, h, w) = processed.pixel_values, processed.grid_thw
        digest = mm_hash(frames, self.video_config, fps=fps)
        per_group = h * w // (self.merge_size * self.merge_size)
        tokens: list[int] = []
        items: list[tuple[MultiModalInput, MediaSpan]] = []
        for g in range(t):
            tokens += stamp_ids[g]
            tokens.append(self.vision_start_id)
            start = offset + len(tokens)
            tokens += [self.video_token_id] * per_group
            tokens.append(self.vision_end_id)
            data = EncoderInput(pixel_values[g * h * w : (g + 1) * h * w], (1, h, w))  # [h * w, patch_dim]
            mm = MultiModalInput(f"{digest}-{g}", PlaceholderRange(start, per_group), "video", 1, data)
            items.append((mm, MediaSpan(start, per_group, (1, h, w))))
        return tokens, items

    def _whole_video(
        self, frames: np.ndarray, fps: float, processed: ProcessedVideo, offset: int
    ) -> tuple[MultiModalInput, MediaSpan]:
        """Qwen2-VL / Qwen2.5-VL: one input for the whole video, its groups encoded one by one."""
        placeholder = PlaceholderRange(offset, processed.num_embeds)
        data = EncoderInput(processed.pixel_values, processed.grid_thw)
        digest = mm_hash(frames, self.video_config, fps=fps)
        mm = MultiModalInput(digest, placeholder, "video", processed.grid_thw[0], data)
        interval = 1.0
        if self.tokens_per_second is not None:
            interval = self.tokens_per_second * self.video_config.temporal_patch_size / fps
        return mm, MediaSpan(offset, processed.num_embeds, processed.grid_thw, interval)
