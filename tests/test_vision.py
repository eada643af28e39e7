"""Vision tower and M-RoPE positions against transformers: the tower loaded from the checkpoint
equals the reference model's `visual`, encoding a video group by group equals encoding it whole,
and prompt positions equal `get_rope_index`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mmserve.encoders.positions import MediaSpan, mrope_positions
from mmserve.encoders.vision import VisionTower

VL_ARCHS = ("qwen2_vl", "qwen2_5_vl")


@pytest.fixture(scope="module", params=VL_ARCHS)
def reference(
    request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]
) -> tuple[Path, torch.nn.Module]:
    from transformers import AutoModelForImageTextToText

    model_dir = tiny_model_dir(request.param)
    return model_dir, AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def random_patches(grid: tuple[int, int, int], model: torch.nn.Module) -> torch.Tensor:
    vc = model.config.vision_config
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    return torch.randn(grid[0] * grid[1] * grid[2], dim, generator=torch.Generator().manual_seed(0))


def test_tower_equals_reference_and_groups_equal_whole(reference: tuple[Path, torch.nn.Module]) -> None:
    model_dir, model = reference
    tower = VisionTower(model.config, model_dir, torch.device("cpu"), torch.float32)
    grid = (4, 8, 12)  # a video of 4 temporal groups
    pixels = random_patches(grid, model)
    with torch.inference_mode():
        expected = model.model.visual(pixels, grid_thw=torch.tensor([grid])).pooler_output
    whole = tower.encode(pixels, grid)
    torch.testing.assert_close(whole, expected, rtol=0, atol=1e-6)
    per_group = 8 * 12
    pieces = [tower.encode(pixels[g * per_group : (g + 1) * per_group], (1, 8, 12)) for g in range(4)]
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=0, atol=1e-6)


def test_positions_equal_get_rope_index(reference: tuple[Path, torch.nn.Module]) -> None:
    _, model = reference
    cfg = model.config
    merge = cfg.vision_config.spatial_merge_size
    image_grid, video_grid = (1, 6, 10), (3, 4, 4)
    n_img = 6 * 10 // merge**2
    n_vid = 3 * 4 * 4 // merge**2
    # text(5) image text(3) video text(4)
    types = [0] * 5 + [1] * n_img + [0] * 3 + [2] * n_vid + [0] * 4
    ids = torch.arange(len(types))[None]
    kwargs = {}
    interval = 1.0
    if cfg.model_type == "qwen2_5_vl":
        seconds_per_group = 2 / 2.0  # temporal_patch_size / fps
        kwargs["second_per_grid_ts"] = torch.tensor([seconds_per_group])
        interval = cfg.vision_config.tokens_per_second * seconds_per_group
    expected, delta = model.model.get_rope_index(
        ids, torch.tensor([types]), torch.tensor([image_grid]), torch.tensor([video_grid]), **kwargs
    )
    spans = [MediaSpan(5, n_img, image_grid), MediaSpan(5 + n_img + 3, n_vid, video_grid, interval)]
    got, got_delta = mrope_positions(len(types), spans, merge)
    assert torch.equal(got, expected[:, 0])
    assert got_delta == int(delta)


def test_text_only_positions_are_plain() -> None:
    positions, delta = mrope_positions(7, [], 2)
    assert torch.equal(positions, torch.arange(7).expand(3, -1)) and delta == 0


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_a_group_encoded_in_slices_of_blocks_equals_it_encoded_whole(
    arch: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    """What the scheduler spreads over steps: begin, then slices of blocks, then finish == one `encode`."""
    from transformers import AutoConfig

    model_dir = tiny_model_dir(arch)
    config = AutoConfig.from_pretrained(model_dir)
    tower = VisionTower(config, model_dir, torch.device("cpu"), torch.float32)
    vc = config.vision_config
    grid = (1, 8, 12)  # Qwen2.5-VL's windows need more than one window per side to differ from full attention
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    pixels = torch.randn(8 * 12, dim, generator=torch.Generator().manual_seed(1))
    whole = tower.encode(pixels, grid)
    assert tower.depth >= 2
    for slices in ([tower.depth], [1] * tower.depth, [tower.depth - 1, 5]):
        state = tower.begin(pixels, grid)
        for n in slices:
            tower.advance(state, n)
        assert torch.equal(tower.finish(state), whole), slices
    state = tower.begin(pixels, grid)
    tower.advance(state, tower.depth - 1)
    with pytest.raises(ValueError, match="blocks have run"):
        tower.finish(state)
