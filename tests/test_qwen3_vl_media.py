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
