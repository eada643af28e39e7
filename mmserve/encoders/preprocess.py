"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL pixel preprocessing: checkpoint config, smart resize, rescale + normalize,
temporal padding, patchify, grid sizes and `mm_hash`. Equal to transformers' PIL image processor, frame by frame
for video (Qwen3-VL's video size rule bounds the whole clip). Knows nothing of decoding, limits, the vision
encoders or the engine.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from mmserve.errors import InvalidRequestError

Modality = Literal["image", "video"]
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD = (0.5, 0.5, 0.5)  # Qwen3-VL's mean and std
MAX_ASPECT_RATIO = 200  # smart_resize refuses anything longer and thinner
QWEN3_VIDEO_PROCESSOR = "Qwen3VLVideoProcessor"  # `video_processor_type` of Qwen3-VL's whole-clip size rule
# transformers' class defaults (Qwen2VLImageProcessorPil / Qwen2VLVideoProcessor) for keys a config omits.
_DEFAULT_SIZE: dict[str, tuple[int, int]] = {
    "image": (56 * 56, 28 * 28 * 1280),
    "video": (128 * 28 * 28, 28 * 28 * 768),
}
# Where each modality's settings live, first found wins (transformers' order). A nested processor_config.json
# is the 5.x layout; a checkpoint without a video file gives the video processor its image file.
_CONFIG_FILES: dict[str, tuple[str, ...]] = {
    "image": ("preprocessor_config.json",),
    "video": ("video_preprocessor_config.json", "preprocessor_config.json"),
}
# Qwen3VLVideoProcessor's class defaults where they differ from Qwen2VLVideoProcessor's.
_QWEN3_VIDEO_DEFAULTS: dict[str, Any] = {
    "size": (128 * 32 * 32, 32 * 32 * 768),  # of the whole clip (frames x height x width)
    "patch_size": 16,
    "mean_std": IMAGENET_STANDARD,
    "max_video_tokens": 768,  # per frame, in merged tokens (Qwen2's is the whole video's budget)
}


@dataclass(frozen=True)
class VisionPreprocessConfig:
    """One processor's settings (image or video) as the checkpoint states them."""

    modality: Modality = "image"
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56  # per frame, after resizing (`size.shortest_edge` in 5.x spelling)
    max_pixels: int = 28 * 28 * 1280  # per frame (`size.longest_edge`)
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3  # PIL resampling filter id: 3 is BICUBIC
    # Video only. The frame rate/count bounds are the checkpoint's own sampling settings, for the engine to
    # read: preprocessing itself never samples (it takes frames as decoded).
    fps: float | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    cap_pixels_per_frame: bool = False  # qwen-vl-utils' total-pixel budget shared by the frames
    max_video_tokens: int = 128000  # that budget's size, in merged tokens (whole_clip: a per-frame ceiling)
    # Qwen3VLVideoProcessor's rule: min/max_pixels bound the pixels of the whole clip (frames rounded to the
    # temporal patch x height x width), not of one frame; frames smaller than `factor` are scaled up first.
    whole_clip: bool = False

    def __post_init__(self) -> None:
        # Tuples, so the config stays hashable (it keys the value-table cache) even when given lists.
        object.__setattr__(self, "image_mean", tuple(float(v) for v in self.image_mean))
        object.__setattr__(self, "image_std", tuple(float(v) for v in self.image_std))
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError(
                f"image_mean / image_std must have 3 entries, std > 0: {self.image_mean} {self.image_std}"
            )

    @property
    def factor(self) -> int:
        """Side lengths after resizing are multiples of this (one merged token covers factor x factor px)."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    pixel_values: torch.Tensor  # [grid_h * grid_w, 3 * temporal_patch * patch * patch] float32
    grid_thw: tuple[int, int, int]  # (1, grid_h, grid_w) in patches
    num_embeds: int  # tokens the encoder emits: grid_t * grid_h * grid_w // merge_size**2


@dataclass(frozen=True, eq=False)
class ProcessedVideo:
    pixel_values: torch.Tensor  # [grid_t * grid_h * grid_w, 3 * temporal_patch * patch * patch] float32
    grid_thw: tuple[int, int, int]  # grid_t = ceil(frames / temporal_patch)
    num_embeds: int


# ------------------------------------------------------------------------------------------------ config


def load_preprocess_config(
    model_dir: str | Path, modality: Modality, video_processor_type: str | None = None
) -> VisionPreprocessConfig:
    """The image or video settings of the checkpoint at `model_dir`. `video_processor_type`: the class the
    model's processor uses whatever the file says (Qwen3-VL: always Qwen3VLVideoProcessor)."""
    model_dir = Path(model_dir)
    raw: Mapping[str, Any] | None = None
    nested = model_dir / "processor_config.json"
    if nested.is_file():
        raw = json.loads(nested.read_text(encoding="utf-8")).get(f"{modality}_processor")
    for name in _CONFIG_FILES[modality]:
        if raw is None and (model_dir / name).is_file():
            raw = json.loads((model_dir / name).read_text(encoding="utf-8"))
    if raw is None:
        raise FileNotFoundError(f"{model_dir} has no {' or '.join(_CONFIG_FILES[modality])}")
    if modality == "video" and video_processor_type is not None:
        raw = {**raw, "video_processor_type": video_processor_type}
    return config_from_dict(raw, modality)


def load_preprocess_configs(
    model_dir: str | Path, model_type: str | None = None
) -> tuple[VisionPreprocessConfig, VisionPreprocessConfig]:
    """(image, video) settings of a checkpoint. With `model_type`, a checkpoint without video settings of its
    own gets its family's video defaults (`family_video_config`) instead of the image file's bounds (what
    transformers would use: far more pixels per frame than Qwen's models are run with)."""
    image = load_preprocess_config(model_dir, "image")
    if model_type is not None and not has_video_config(model_dir):
        return image, family_video_config(image, model_type)
    video_type = QWEN3_VIDEO_PROCESSOR if model_type in ("qwen3_vl", "qwen3_vl_moe") else None
    return image, load_preprocess_config(model_dir, "video", video_type)


def config_from_dict(raw: Mapping[str, Any], modality: Modality) -> VisionPreprocessConfig:
    """Parse a `preprocessor_config.json`-style dict; keys it omits take transformers' class defaults."""
    # As transformers' __init__: a `size` dict replaces the default whole; top-level min/max_pixels win.
    size = raw.get("size")
    if size is None:
        size = dict(zip(("shortest_edge", "longest_edge"), _DEFAULT_SIZE[modality], strict=True))
    min_pixels = _first(raw.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels"))
    max_pixels = _first(raw.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels"))
    if min_pixels is None or max_pixels is None:
        raise ValueError(f"{modality} processor config needs min/max pixels, got size={size!r}")
    kw: dict[str, Any] = {
        "modality": modality,
        "min_pixels": int(min_pixels),
        "max_pixels": int(max_pixels),
        "image_mean": _triple(raw.get("image_mean", CLIP_MEAN)),
        "image_std": _triple(raw.get("image_std", CLIP_STD)),
    }
    for name in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
        if raw.get(name) is not None:
            kw[name] = int(raw[name])
    for name in ("do_resize", "do_rescale", "do_normalize"):
        if raw.get(name) is not None:
            kw[name] = bool(raw[name])
    if raw.get("rescale_factor") is not None:
        kw["rescale_factor"] = float(raw["rescale_factor"])
    if modality == "video":
        kw["fps"] = None if raw.get("fps") is None else float(raw["fps"])
        kw["min_frames"] = int(_first(raw.get("min_frames"), 4))
        kw["max_frames"] = int(_first(raw.get("max_frames"), 768))
        kw["cap_pixels_per_frame"] = bool(raw.get("cap_pixels_per_frame") or False)
        kw["max_video_tokens"] = int(_first(raw.get("max_video_tokens"), 128000))
        if raw.get("video_processor_type") == QWEN3_VIDEO_PROCESSOR:  # its class defaults, whole-clip sizes
            kw["whole_clip"] = True
            kw["fps"] = float(_first(raw.get("fps"), 2))
            kw["max_video_tokens"] = int(_first(raw.get("max_video_tokens"), _QWEN3_VIDEO_DEFAULTS["max_video_tokens"]))
            kw["patch_size"] = int(_first(raw.get("patch_size"), _QWEN3_VIDEO_DEFAULTS["patch_size"]))
            if raw.get("size") is None and raw.get("min_pixels") is None and raw.get("max_pixels") is None:
                kw["min_pixels"], kw["max_pixels"] = _QWEN3_VIDEO_DEFAULTS["size"]
            kw["image_mean"] = _triple(raw.get("image_mean", _QWEN3_VIDEO_DEFAULTS["mean_std"]))
            kw["image_std"] = _triple(raw.get("image_std", _QWEN3_VIDEO_DEFAULTS["mean_std"]))
    return VisionPreprocessConfig(**kw)


def has_video_config(model_dir: str | Path) -> bool:
    """Whether the checkpoint states video settings of its own (else transformers gives the video processor
    the image file, and with it the image pixel bounds)."""
    model_dir = Path(model_dir)
    nested = model_dir / "processor_config.json"
    if nested.is_file() and json.loads(nested.read_text(encoding="utf-8")).get("video_processor") is not None:
        return True
    return (model_dir / "video_preprocessor_config.json").is_file()


def family_video_config(image: VisionPreprocessConfig, model_type: str) -> VisionPreprocessConfig:
    """The video settings Qwen's own preprocessing applies to a checkpoint that states none, from its image
    settings (patch sizes, mean, std...). Qwen2-VL / Qwen2.5-VL: qwen-vl-utils' bounds (128..768 merged tokens
    of 28 x 28 px per frame, and 128000 tokens' worth x 0.9 of pixels shared by the frames), 2 fps. Qwen3-VL:
    Qwen3VLVideoProcessor's class defaults (a whole-clip pixel bound, 2 fps)."""
    common: dict[str, Any] = {"modality": "video", "fps": 2.0, "min_frames": 4, "max_frames": 768}
    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        lo, hi = _QWEN3_VIDEO_DEFAULTS["size"]
        return dataclasses.replace(
            image, **common, min_pixels=lo, max_pixels=hi, whole_clip=True, cap_pixels_per_frame=False,
            max_video_tokens=_QWEN3_VIDEO_DEFAULTS["max_video_tokens"],
        )  # fmt: skip
    return dataclasses.replace(
        image, **common, min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28, cap_pixels_per_frame=True,
        max_video_tokens=128000, whole_clip=False,
    )  # fmt: skip


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _triple(value: float | list[float] | tuple[float, ...]) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ValueError(f"expected 3 channel values, got {value!r}")
    return values[0], values[1], values[2]


# ----------------------------------------------------------------------------------------------- sizes


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280
) -> tuple[int, int]:
    """Qwen2-VL's resize rule: sides multiples of `factor`, area within [min_pixels, max_pixels], aspect
    ratio kept as closely as possible. Raises `InvalidRequestError` (a ValueError) for a ratio over 200."""
    _check_size(height, width)
    return _bounded_sides(height, width, factor, min_pixels, max_pixels)


def smart_resize_clip(
    num_frames: int,
    height: int,
    width: int,
    temporal_factor: int = 2,
    factor: int = 32,
    min_pixels: int = 128 * 32 * 32,
    max_pixels: int = 32 * 32 * 768,
) -> tuple[int, int]:
    """Qwen3-VL's video resize rule: as `smart_resize`, but the bounds are on frames (rounded to the temporal
    factor) x height x width, and a frame with a side under `factor` is first scaled up to reach it."""
    if height >= 1 and width >= 1 and (height < factor or width < factor):
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_size(height, width)
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    return _bounded_sides(height, width, factor, min_pixels, max_pixels, num_frames, t_bar)


def _check_size(height: int, width: int) -> None:
    if height < 1 or width < 1:
        raise InvalidRequestError(f"has an empty size {width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequestError(
            f"aspect ratio {max(height, width) / min(height, width):.1f} exceeds {MAX_ASPECT_RATIO} ({width}x{height})"
        )


def _bounded_sides(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1, frames_bar: int = 1
) -> tuple[int, int]:
    """Sides rounded to multiples of `factor`, then scaled so that frames_bar x height x width (frames_bar:
    the frame count as rounded; `frames` as given scales the correction) lies within the pixel bounds."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if frames_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif frames_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resized_size(
    height: int, width: int, cfg: VisionPreprocessConfig, num_frames: int = 1
) -> tuple[int, int]:
    """(height, width) every frame is resized to. `num_frames` (before padding) matters only for a video
    config with `cap_pixels_per_frame`, where the frames share one pixel budget."""
    if not cfg.do_resize:
        if height % cfg.factor or width % cfg.factor:
            raise InvalidRequestError(
                f"size {width}x{height} is not a multiple of {cfg.factor} and the checkpoint disables resizing"
            )
        return height, width
    max_pixels = cfg.max_pixels
    if cfg.modality == "video" and cfg.whole_clip:
        # Qwen3VLVideoProcessor.resize (it refuses fewer frames than the temporal patch; they are padded here).
        frames = max(num_frames, cfg.temporal_patch_size)
        if cfg.cap_pixels_per_frame:
            frame_cap = cfg.max_video_tokens * cfg.factor * cfg.factor
            max_pixels = max(min(frame_cap, max_pixels // frames), int(cfg.min_pixels * 1.05)) * frames
        return smart_resize_clip(
            frames, height, width, cfg.temporal_patch_size, cfg.factor, cfg.min_pixels, max_pixels
        )
    if cfg.modality == "video" and cfg.cap_pixels_per_frame:
        # Qwen2VLVideoProcessor.resize with cap_pixels_per_frame=True (qwen-vl-utils' rule).
        total_pixels = int(cfg.max_video_tokens * cfg.factor * cfg.factor * 0.9)
        max_pixels = max(
            min(max_pixels, total_pixels * cfg.temporal_patch_size // num_frames), int(cfg.min_pixels * 1.05)
        )
    return smart_resize(height, width, cfg.factor, cfg.min_pixels, max_pixels)


def image_grid_thw(height: int, width: int, cfg: VisionPreprocessConfig) -> tuple[int, int, int]:
    """Patch grid of an image of this size, without touching pixels."""
    h, w = resized_size(height, width, cfg)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def video_grid_thw(
    num_frames: int, height: int, width: int, cfg: VisionPreprocessConfig
) -> tuple[int, int, int]:
    """Patch grid of a video of `num_frames` frames of this size (frames padded to the temporal patch)."""
    h, w = resized_size(height, width, cfg, num_frames)
    return -(-num_frames // cfg.temporal_patch_size), h // cfg.patch_size, w // cfg.patch_size


def num_embeds(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    """Embedding tokens the encoder emits for this grid (merge_size x merge_size patches per token)."""
    t, h, w = grid_thw
    return t * h * w // (merge_size * merge_size)


# ---------------------------------------------------------------------------------------------- pixels


def preprocess_image(img: Image.Image, cfg: VisionPreprocessConfig, *, item: str = "image") -> ProcessedImage:
    """Resize (PIL, in uint8), rescale, normalize and patchify one RGB image, as transformers' PIL backend."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    try:
        h, w = resized_size(img.height, img.width, cfg)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{item}: {exc}") from exc
    if (h, w) != (img.height, img.width):
        img = img.resize((w, h), resample=cfg.resample)
    frames = np.asarray(img)[None]  # [1, H, W, 3] uint8; patchify repeats it over the temporal patch
    pixel_values, grid = _patchify(frames, cfg)
    return ProcessedImage(torch.from_numpy(pixel_values), grid, num_embeds(grid, cfg.merge_size))


def preprocess_video(
    frames: np.ndarray,
    cfg: VisionPreprocessConfig,
    *,
    item: str = "video",
    size: tuple[int, int] | None = None,
) -> ProcessedVideo:
    """The image processing applied to each frame of `frames` [T, H, W, 3] uint8, the frame count padded to
    a multiple of the temporal patch by repeating the last frame, patches grouped by temporal patch.

    `size`: the (height, width) `resized_size` gave for the source's own frame size, when the frames were
    resized to it already (while decoding); they are then not resized again."""
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise InvalidRequestError(
            f"{item}: frames must be uint8 [T, H, W, 3], got {frames.dtype} {list(frames.shape)}"
        )
    t, height, width, _ = frames.shape
    try:
        h, w = resized_size(height, width, cfg, num_frames=t) if size is None else size
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{item}: {exc}") from exc
    if (h, w) != (height, width):
        resized = np.empty((t, h, w, 3), np.uint8)
        for i in range(t):  # one PIL call per frame; no per-pixel Python
            resized[i] = np.asarray(Image.fromarray(frames[i]).resize((w, h), resample=cfg.resample))
        frames = resized
    if pad := -t % cfg.temporal_patch_size:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    pixel_values, grid = _patchify(frames, cfg)
    return ProcessedVideo(torch.from_numpy(pixel_values), grid, num_embeds(grid, cfg.merge_size))


def _patchify(frames: np.ndarray, cfg: VisionPreprocessConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[T, H, W, 3] uint8 (T = 1 or a multiple of the temporal patch) -> ([N, 3 * tp * p * p] float32, grid).

    Rows go (t, h/m, w/m, m_h, m_w) and columns (C, tp, p_h, p_w), as transformers' patchify: each
    merge_size x merge_size block of patches is contiguous. Patches are cut from uint8 (4x less to move),
    then rescale + normalize become one lookup per channel value.
    """
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if frames.shape[0] == 1 and tp > 1:
        frames = np.broadcast_to(frames, (tp, *frames.shape[1:]))  # an image fills its temporal patch
    t, h, w, c = frames.shape
    gt, gh, gw = t // tp, h // p, w // p
    x = frames.reshape(gt, tp, gh // m, m, p, gw // m, m, p, c)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # (gt, gh/m, gw/m, m_h, m_w, C, tp, p_h, p_w)
    x = x.reshape(gt * gh * gw, c * tp * p * p)  # uint8 copy
    lut = _value_table(cfg)  # [3, 256] float32
    out = np.empty(x.shape, np.float32)
    span = tp * p * p  # columns per channel
    for ch in range(c):
        np.take(lut[ch], x[:, ch * span : (ch + 1) * span], out=out[:, ch * span : (ch + 1) * span])
    return out, (gt, gh, gw)


@functools.lru_cache(maxsize=32)
def _value_table(cfg: VisionPreprocessConfig) -> np.ndarray:
    """[3, 256] float32: what rescale then normalize make of each uint8 value, per channel, computed with
    transformers' exact dtypes (rescale in float64 then float32; normalize in float32)."""
    x: np.ndarray = np.tile(np.arange(256, dtype=np.uint8), (3, 1))
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        x = x.astype(np.float32)
        mean = np.array(cfg.image_mean, dtype=np.float32)[:, None]
        std = np.array(cfg.image_std, dtype=np.float32)[:, None]
        x = (x - mean) / std
    table = x.astype(np.float32)
    table.flags.writeable = False
    return table


# -------------------------------------------------------------------------------------------------- hash


def mm_hash(
    pixels: np.ndarray | Image.Image, cfg: VisionPreprocessConfig, *, fps: float | None = None
) -> str:
    """Content hash (blake2b-256 hex) of decoded uint8 pixels ([H, W, 3] image or [T, H, W, 3] video), their
    shape and every processing parameter; `fps` too for video (it sets Qwen2.5-VL's temporal positions).

    The same pixels from different containers (PNG, BMP, lossless WEBP...) hash the same.
    """
    arr = np.asarray(pixels.convert("RGB") if isinstance(pixels, Image.Image) else pixels)
    if arr.dtype != np.uint8:
        raise ValueError(f"mm_hash takes uint8 pixels, got {arr.dtype}")
    arr = np.ascontiguousarray(arr)
    meta = {"version": 1, "shape": list(arr.shape), "config": asdict(cfg), "fps": fps}
    digest = hashlib.blake2b(digest_size=32)
    digest.update(json.dumps(meta, sort_keys=True).encode())
    digest.update(b"\x00")
    digest.update(arr.data)
    return digest.hexdigest()
