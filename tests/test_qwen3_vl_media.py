"""Qwen3-VL media against transformers: the vision tower with its DeepStack features (image; a video
whole vs one temporal group at a time), the whole-clip video resize rule, frame timestamps, the
timestamped video prompt and its M-RoPE positions vs `get_rope_index`, per-group inputs, and the
family video defaults for checkpoints without a video processor config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmserve.encoders.vision import VisionTower
from mmserve.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_vl"), arch="qwen3_vl", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def qwen3_model(qwen3_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(qwen3_dir, dtype=torch.float32).eval()


def _patches(grid: tuple[int, int, int], model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    vc = model.config.vision_config
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    return torch.randn(grid[0] * grid[1] * grid[2], dim, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ vision tower


def test_tower_image_equals_get_image_features(qwen3_dir: Path, qwen3_model: torch.nn.Module) -> None:
    tower = VisionTower(qwen3_model.config, qwen3_dir, torch.device("cpu"), torch.float32)
    vc = qwen3_model.config.vision_config
    levels = len(vc.deepstack_visual_indexes)
    assert levels >= 1 and tower.num_deepstack_levels == levels
    assert tower.embed_width == vc.out_hidden_size * (1 + levels)
    grid = (1, 6, 10)
    pixels = _patches(grid, qwen3_model)
    with torch.inference_mode():
        ref = qwen3_model.model.get_image_features(pixels, torch.tensor([grid]))
    got = tower.encode(pixels, grid)
    assert got.shape == (6 * 10 // 4, tower.embed_width)
    d = vc.out_hidden_size
    torch.testing.assert_close(got[:, :d], ref.pooler_output[0], rtol=0, atol=1e-6)
    for i, level in enumerate(ref.deepstack_features):
        torch.testing.assert_close(got[:, (1 + i) * d : (2 + i) * d], level[0], rtol=0, atol=1e-6)


def test_tower_video_groups_equal_whole(qwen3_dir: Path, qwen3_model: torch.nn.Module) -> None:
    """Attention is per temporal group and position embeddings per (h, w): one group at a time is exact."""
    tower = VisionTower(qwen3_model.config, qwen3_dir, torch.device("cpu"), torch.float32)
    grid = (3, 4, 6)
    pixels = _patches(grid, qwen3_model, seed=1)
    with torch.inference_mode():
        ref = qwen3_model.model.get_video_features(pixels, torch.tensor([grid]))
    whole = tower.encode(pixels, grid)
    expected = torch.cat([ref.pooler_output[0], *(level[0] for level in ref.deepstack_features)], dim=-1)
    torch.testing.assert_close(whole, expected, rtol=0, atol=1e-6)
    rows = 4 * 6
    pieces = [tower.encode(pixels[g * rows : (g + 1) * rows], (1, 4, 6)) for g in range(3)]
    diff = (torch.cat(pieces) - whole).abs().max().item()
    assert diff <= 1e-6, diff


def test_tower_qwen3_vl_moe_loads(tmp_path_factory: pytest.TempPathFactory) -> None:
    from transformers import AutoConfig

    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_vl_moe"), arch="qwen3_vl_moe", preset="tiny")
    config = AutoConfig.from_pretrained(model_dir)
    tower = VisionTower(config, model_dir, torch.device("cpu"), torch.float32)
    vc = config.vision_config
    grid = (1, 4, 4)
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    out = tower.encode(torch.randn(16, dim), grid)
    assert out.shape == (4, vc.out_hidden_size * (1 + len(vc.deepstack_visual_indexes)))
    assert torch.isfinite(out).all()


class _ThreadGroup:
    """Two ranks as two threads: all_reduce sums what every rank passed (enough for `shard_tower`)."""

    def __init__(self, rank: int, world_size: int, shared: list, barrier: object) -> None:
        self.rank, self.world_size, self._shared, self._barrier = rank, world_size, shared, barrier

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._shared[self.rank] = x
        self._barrier.wait()  # type: ignore[attr-defined]
        total = sum(self._shared[1:], self._shared[0].clone())
        self._barrier.wait()  # type: ignore[attr-defined]
        return total


def test_sharded_tower_equals_whole(qwen3_dir: Path, qwen3_model: torch.nn.Module) -> None:
    """Weights-mode tensor parallelism over 2 ranks: qkv / linear_fc1 by heads and features, proj / linear_fc2
    row-parallel; the forward reshapes qkv by the (halved) num_heads, so each rank's output matches."""
    import threading

    grid = (2, 4, 6)
    pixels = _patches(grid, qwen3_model, seed=2)
    whole = VisionTower(qwen3_model.config, qwen3_dir, torch.device("cpu"), torch.float32).encode(pixels, grid)
    shared: list = [None, None]
    barrier = threading.Barrier(2)
    towers = [
        VisionTower(qwen3_model.config, qwen3_dir, torch.device("cpu"), torch.float32, _ThreadGroup(r, 2, shared, barrier))  # type: ignore[arg-type]
        for r in range(2)
    ]
    assert towers[1].model.blocks[0].attn.num_heads == qwen3_model.config.vision_config.num_heads // 2
    outs: list = [None, None]

    def run(rank: int) -> None:
        outs[rank] = towers[rank].encode(pixels, grid)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for out in outs:
        torch.testing.assert_close(out, whole, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ preprocessing


def test_tiny_checkpoint_configs_parse(qwen3_dir: Path) -> None:
    from mmserve.encoders.preprocess import load_preprocess_configs

    image, video = load_preprocess_configs(qwen3_dir, "qwen3_vl")  # it has its own video file: used as is
    assert (image.patch_size, image.factor, image.image_mean, image.whole_clip) == (16, 32, (0.5,) * 3, False)
    assert (image.min_pixels, image.max_pixels) == (4096, 65536)  # its `size` dict
    assert video.whole_clip and (video.patch_size, video.fps, video.min_frames) == (16, 2.0, 4)
    assert (video.min_pixels, video.max_pixels) == (8192, 262144)


def test_image_equals_transformers(qwen3_dir: Path) -> None:
    import numpy as np
    from PIL import Image
    from transformers import AutoImageProcessor

    from mmserve.encoders.preprocess import load_preprocess_config, preprocess_image

    cfg = load_preprocess_config(qwen3_dir, "image")
    proc = AutoImageProcessor.from_pretrained(qwen3_dir)
    for h, w in ((64, 96), (300, 451), (20, 700)):
        img = Image.fromarray(np.random.default_rng(h).integers(0, 256, (h, w, 3), dtype=np.uint8))
        ours = preprocess_image(img, cfg)
        ref = proc(images=[img], return_tensors="pt")
        assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
        assert torch.equal(ours.pixel_values, ref["pixel_values"])


def test_whole_clip_smart_resize_equals_transformers() -> None:
    import itertools

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_smart_resize

    from mmserve.encoders.preprocess import smart_resize_clip

    sizes = [(h, w) for h, w in itertools.product((5, 17, 31, 32, 64, 100, 144, 361, 720, 1080, 2160), repeat=2)]
    sizes += [(10, 1900), (3000, 16), (7, 7), (1, 150)]
    bounds = [(128 * 32 * 32, 32 * 32 * 768), (4096, 25165824), (8192, 262144)]
    checked = 0
    for (h, w), frames, (lo, hi) in itertools.product(sizes, (2, 3, 4, 5, 7, 16, 61, 768), bounds):
        try:
            expected = hf_smart_resize(frames, h, w, temporal_factor=2, factor=32, min_pixels=lo, max_pixels=hi)
        except ValueError:
            with pytest.raises(ValueError):  # InvalidRequestError is a ValueError
                smart_resize_clip(frames, h, w, 2, 32, lo, hi)
            continue
        assert smart_resize_clip(frames, h, w, 2, 32, lo, hi) == expected, (h, w, frames, lo, hi)
        checked += 1
    assert checked > 2000


@pytest.mark.parametrize("cap", [False, True])
def test_video_grids_equal_qwen3_video_processor(qwen3_dir: Path, cap: bool) -> None:
    """Our grid (config parsed from the checkpoint, and the class defaults) equals Qwen3VLVideoProcessor's
    own count (its `get_num_of_video_patches` follows `resize`, incl. the cap_pixels_per_frame variant)."""
    import dataclasses

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from mmserve.encoders.preprocess import (
        family_video_config,
        load_preprocess_config,
        video_grid_thw,
    )

    ours_ckpt = dataclasses.replace(load_preprocess_config(qwen3_dir, "video"), cap_pixels_per_frame=cap)
    ours_default = family_video_config(load_preprocess_config(qwen3_dir, "image"), "qwen3_vl")
    ours_default = dataclasses.replace(ours_default, cap_pixels_per_frame=cap)
    for ours, proc in (
        (ours_ckpt, Qwen3VLVideoProcessor.from_pretrained(qwen3_dir)),
        (ours_default, Qwen3VLVideoProcessor()),
    ):
        for frames, h, w in ((4, 64, 96), (5, 720, 1280), (7, 144, 176), (60, 1080, 1920), (600, 480, 640), (2, 20, 40)):
            t, gh, gw = video_grid_thw(frames, h, w, ours)
            expected = proc.get_num_of_video_patches(frames, h, w, {"cap_pixels_per_frame": cap})
            assert t * gh * gw == expected, (frames, h, w)
            assert t == -(-frames // 2)
