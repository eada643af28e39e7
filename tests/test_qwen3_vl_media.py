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
from tests.test_media import make_clip


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
    # Exact up to fp32 rounding: the GEMMs over one group's rows and over all rows may be blocked differently
    # (MKL picks by shape and CPU: 0 on one machine, a few ulps of the largest value on another). Attention
    # leaking across groups would differ by orders of magnitude more.
    diff = (torch.cat(pieces) - whole).abs().max().item()
    assert diff <= 1e-6 * max(1.0, whole.abs().max().item()), diff


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


def test_qwen3_video_settings_use_its_rule_whatever_the_file_says(qwen3_dir: Path, tmp_path: Path) -> None:
    """The 5.x nested layout may omit `video_processor_type`; Qwen3-VL's processor still is Qwen3VLVideoProcessor."""
    import json
    import shutil

    from mmserve.encoders.preprocess import load_preprocess_configs

    shutil.copy(qwen3_dir / "preprocessor_config.json", tmp_path)
    video = {"size": {"shortest_edge": 4096, "longest_edge": 25165824}, "patch_size": 16, "fps": 2}
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": video}))
    _, parsed = load_preprocess_configs(tmp_path, "qwen3_vl")
    assert parsed.whole_clip and (parsed.min_pixels, parsed.max_pixels) == (4096, 25165824)
    _, as_qwen2 = load_preprocess_configs(tmp_path)  # no model type: the file alone (no type: Qwen2's rule)
    assert not as_qwen2.whole_clip
    (tmp_path / "processor_config.json").unlink()  # no video settings at all: Qwen3VLVideoProcessor's defaults
    _, default = load_preprocess_configs(tmp_path, "qwen3_vl")
    assert default.whole_clip and (default.min_pixels, default.max_pixels, default.fps) == (128 * 1024, 768 * 1024, 2.0)


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


# ------------------------------------------------------------------------------ timestamped video prompts


def _clip(num_frames: int, fps: int, size: tuple[int, int] = (96, 64)) -> bytes:
    """An H.264 mp4 of `num_frames` frames at `fps` (test_media's synthetic clip, 96x64 by default)."""
    return make_clip(num_frames, fps, size)


@pytest.mark.parametrize(("num_frames", "source_fps", "sample_fps"), [(7, 4, 4.0), (6, 4, 4.0), (14, 8, 2.0), (12, 8, 2.0)])
def test_timestamps_equal_calculate_timestamps(num_frames: int, source_fps: int, sample_fps: float) -> None:
    """Real frame times of a decoded constant-rate clip, grouped, equal transformers' frame_index / fps rule;
    odd and even sampled frame counts (the odd one pads by repeating the last frame)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    from mmserve.encoders.media import MediaLimits, load_video
    from mmserve.engine.mm_processor import frame_group_timestamps

    video = load_video(_clip(num_frames, source_fps), MediaLimits(video_fps=sample_fps))
    step = round(source_fps / sample_fps)
    indices = list(range(0, num_frames, step))
    assert video.num_frames == len(indices)
    expected = Qwen3VLProcessor._calculate_timestamps(None, indices, float(source_fps), 2)  # type: ignore[arg-type]
    got = frame_group_timestamps(video.timestamps_s, 2)
    assert len(got) == -(-len(indices) // 2)
    assert got == pytest.approx(expected, abs=1e-9)


@pytest.fixture(scope="module")
def mm(qwen3_dir: Path, qwen3_model: torch.nn.Module):  # -> (MultiModalProcessor, tokenizer)
    from transformers import AutoTokenizer

    from mmserve.engine.mm_processor import MultiModalProcessor

    tok = AutoTokenizer.from_pretrained(qwen3_dir)
    proc = MultiModalProcessor(
        qwen3_dir, qwen3_model.config, encode=lambda t: tok.encode(t, add_special_tokens=False), max_model_len=4096
    )
    yield proc, tok
    proc.decoder.close()


PROMPT = (
    "<|im_start|>user\nLook <|vision_start|><|image_pad|><|vision_end|> then "
    "<|vision_start|><|video_pad|><|vision_end|> and tell me.<|im_end|>\n<|im_start|>assistant\n"
)


def _image():  # -> PIL.Image
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(5).integers(0, 256, (64, 96, 3), dtype=np.uint8))


def test_expansion_and_positions_equal_transformers(mm, qwen3_model: torch.nn.Module, qwen3_dir: Path) -> None:
    """Text, an image, a 7-frame encoded video with timestamps and more text: our ids equal the tokenizer on
    transformers' `replace_video_token` text (so a timestamp tokenized alone gives the ids it has in context),
    and our M-RoPE positions equal `Qwen3VLModel.get_rope_index` with the whole video's grid."""
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    proc, tok = mm
    ids = tok.encode(PROMPT, add_special_tokens=False)
    out = proc.expand(ids, [_image()], [_clip(7, 2)])  # 7 frames at 2 fps: sampled whole, 4 groups
    image_mm, *video_mms = out.mm_inputs
    t = len(video_mms)
    assert t == 4
    (_, h, w) = video_mms[0].data.grid_thw  # type: ignore[attr-defined]
    image_grid = image_mm.data.grid_thw  # type: ignore[attr-defined]

    # Qwen3VLProcessor itself needs torchvision to be built; its method runs on the attributes it reads.
    hf = SimpleNamespace(
        video_processor=Qwen3VLVideoProcessor.from_pretrained(qwen3_dir),
        video_token="<|video_pad|>", vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
        _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a),  # type: ignore[arg-type]
    )  # fmt: skip
    meta = SimpleNamespace(fps=2.0, frames_indices=list(range(7)))
    grids = {"video_grid_thw": torch.tensor([[t, h, w]]), "video_metadata": [meta]}
    video_text = Qwen3VLProcessor.replace_video_token(hf, grids, 0)  # type: ignore[arg-type]
    assert "<0.2 seconds>" in video_text and "<3.0 seconds>" in video_text  # (0 + 0.5) / 2 ... (3 + 3) / 2
    n_image = image_grid[1] * image_grid[2] // 4
    text = PROMPT.replace("<|image_pad|>", "<|image_pad|>" * n_image).replace("<|video_pad|>", video_text)
    assert out.token_ids == tok.encode(text, add_special_tokens=False)
    # Each timestamp sits between special tokens: alone it tokenizes as in context.
    start = tok.convert_tokens_to_ids("<|vision_start|>")
    for stamp in ("<0.2 seconds>", "<3.0 seconds>", "<12.8 seconds>"):
        alone = tok.encode(stamp, add_special_tokens=False)
        assert tok.encode(f"<|vision_start|>{stamp}<|vision_start|>", add_special_tokens=False) == [start, *alone, start]

    types = [1 if i == proc.image_token_id else 2 if i == proc.video_token_id else 0 for i in out.token_ids]
    expected, delta = qwen3_model.model.get_rope_index(
        torch.tensor([out.token_ids]),
        torch.tensor([types]),
        torch.tensor([image_grid]),
        torch.tensor([[t, h, w]]),
    )
    assert torch.equal(out.mrope_positions, expected[:, 0])
    assert out.mrope_delta == int(delta)


def test_per_group_inputs(mm) -> None:
    proc, tok = mm
    ids = tok.encode("<|vision_start|><|video_pad|><|vision_end|>x<|vision_start|><|video_pad|><|vision_end|>")
    clip = _clip(6, 2)
    other = _clip(5, 2)
    out = proc.expand(ids, [], [clip, other])
    first, second = out.mm_inputs[:3], out.mm_inputs[3:]
    assert (len(first), len(second)) == (3, 3)
    for item in out.mm_inputs:
        assert (item.modality, item.num_groups) == ("video", 1)
        start, end = item.group_range(0)
        assert set(out.token_ids[start:end]) == {proc.video_token_id}
        assert out.token_ids[start - 1] == proc.vision_start_id and out.token_ids[end] == proc.vision_end_id
        data = item.data
        _, h, w = data.grid_thw  # type: ignore[attr-defined]
        assert data.grid_thw[0] == 1 and data.pixel_values.shape[0] == h * w  # type: ignore[attr-defined]
        assert data.pixel_values._base is not None  # type: ignore[attr-defined]  # a view of the video's rows
    assert sum(m.placeholder.length for m in out.mm_inputs) == out.token_ids.count(proc.video_token_id)
    hashes = [m.mm_hash for m in out.mm_inputs]
    assert len(set(hashes)) == 6  # distinct per group and per video
    digest = hashes[0].rsplit("-", 1)[0]
    assert hashes[:3] == [f"{digest}-{g}" for g in range(3)]
    again = proc.expand(ids, [], [clip, other])
    assert [m.mm_hash for m in again.mm_inputs] == hashes  # the same video: the same hashes
    # Rows of the groups, in order, are the whole video's rows.
    from mmserve.encoders.media import load_video
    from mmserve.encoders.preprocess import preprocess_video

    whole = preprocess_video(load_video(clip, proc.video_limits).frames, proc.video_config)
    assert torch.equal(torch.cat([m.data.pixel_values for m in first]), whole.pixel_values)  # type: ignore[attr-defined]


def test_checkpoint_sampling_settings_apply(mm) -> None:
    proc, _ = mm
    assert proc.video_limits.video_fps == proc.video_config.fps == 2.0
    assert proc.video_limits.max_video_frames == min(768, proc.video_config.max_frames or 768)


# ------------------------------------------------------------------------------ videos that fit (all families)


def _hub_like_qwen2_vl(tmp_path: Path) -> Path:
    """A Qwen2-VL checkpoint as on the hub: preprocessor_config.json only, with the image bounds of
    Qwen2-VL-2B (3136 .. 12845056 pixels)."""
    import json

    model_dir = make_tiny_model(tmp_path / "qwen2_vl", arch="qwen2_vl", preset="tiny")
    (model_dir / "video_preprocessor_config.json").unlink()
    cfg = json.loads((model_dir / "preprocessor_config.json").read_text())
    cfg.update(min_pixels=3136, max_pixels=12845056, size={"shortest_edge": 3136, "longest_edge": 12845056})
    (model_dir / "preprocessor_config.json").write_text(json.dumps(cfg))
    return model_dir


def test_family_video_defaults_fit(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from mmserve.encoders.preprocess import (
        load_preprocess_config,
        load_preprocess_configs,
        num_embeds,
        video_grid_thw,
    )
    from mmserve.engine.mm_processor import MultiModalProcessor

    model_dir = _hub_like_qwen2_vl(tmp_path)
    as_image = load_preprocess_config(model_dir, "video")  # transformers' fallback: the image file
    _, video = load_preprocess_configs(model_dir, "qwen2_vl")
    assert video.cap_pixels_per_frame and (video.min_pixels, video.max_pixels) == (128 * 28 * 28, 768 * 28 * 28)
    # A 30 s 720p clip sampled at 2 fps.
    image_bounds = num_embeds(video_grid_thw(60, 720, 1280, as_image), 2)
    family = num_embeds(video_grid_thw(60, 720, 1280, video), 2)
    assert image_bounds > 32768 > family and family < 0.65 * image_bounds, (image_bounds, family)  # 35880 vs 21600
    # qwen-vl-utils' fetch_video budget: max(min(VIDEO_MAX_PIXELS, total / nframes * 2), min_pixels * 1.05)
    for frames in (8, 60, 600):
        budget = max(min(768 * 28 * 28, int(128000 * 28 * 28 * 0.9) * 2 // frames), int(128 * 28 * 28 * 1.05))
        _, gh, gw = video_grid_thw(frames, 720, 1280, video)
        assert gh * gw * 14 * 14 <= budget

    proc = MultiModalProcessor(model_dir, AutoConfig.from_pretrained(model_dir), max_model_len=32768)
    assert proc.video_config == video and not proc.timestamped_videos
    proc.decoder.close()


def test_video_over_the_context_is_refused_before_preprocessing(mm, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    import mmserve.engine.mm_processor as mod
    from mmserve.errors import PromptTooLongError

    proc, tok = mm
    ids = tok.encode("<|vision_start|><|video_pad|><|vision_end|>")

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("preprocessed a video that cannot fit")

    monkeypatch.setattr(mod, "preprocess_video", never)
    monkeypatch.setattr(proc, "max_model_len", 64)
    frames = np.zeros((16, 256, 256, 3), np.uint8)
    with pytest.raises(PromptTooLongError, match=r"video 0: its \d+ tokens"):
        proc.expand(ids, [], [frames])
    # An encoded clip: planned in a decode worker from its headers, never decoded.
    monkeypatch.setattr(proc.decoder, "load_video", never)
    with pytest.raises(PromptTooLongError, match=r"video 0: its \d+ tokens"):
        proc.expand(ids, [], [_clip(16, 8, size=(320, 240))])


class _PlanningPool:
    """A decode pool that plans (frame count and size before decoding) and resizes while decoding, as the
    decode pool's `plan_video` / `load_video(resize_to=...)`; built on `media.load_video` here."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def plan_video(self, source: object, limits: object, *, item: str, param: str | None = None) -> object:
        from types import SimpleNamespace

        from mmserve.encoders.media import load_video

        self.calls.append("plan")
        v = load_video(source, limits, item=item, param=param)  # type: ignore[arg-type]
        t, h, w, _ = v.frames.shape
        return SimpleNamespace(width=w, height=h, num_frames=t, fps=v.fps, duration_s=v.duration_s, timestamps_s=None)

    def load_video(
        self, source: object, limits: object, *, item: str, param: str | None = None,
        resize_to: tuple[int, int] | None = None, resample: int = 3,
    ) -> object:  # fmt: skip
        import numpy as np
        from PIL import Image

        from mmserve.encoders.media import DecodedVideo, load_video

        self.calls.append(f"load {resize_to}")
        v = load_video(source, limits, item=item, param=param)  # type: ignore[arg-type]
        if resize_to is None:
            return v
        h, w = resize_to
        frames = np.stack([np.asarray(Image.fromarray(f).resize((w, h), resample=resample)) for f in v.frames])
        return DecodedVideo(frames, v.fps, v.source_fps, v.duration_s, v.timestamps_s)

    def load_image(self, source: object, limits: object, *, item: str, param: str | None = None) -> object:
        from mmserve.encoders.media import load_image

        return load_image(source, limits, item=item, param=param)  # type: ignore[arg-type]

    def close(self) -> None:
        pass


def test_planned_decoding_gives_the_same_prompt_and_refuses_before_decoding(
    mm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a pool that plans, the video is sized from its headers, decoded already resized, and gives the
    prompt of decoding it whole; one over the context is refused with no frame decoded."""
    from mmserve.errors import PromptTooLongError

    proc, tok = mm
    ids = tok.encode(PROMPT, add_special_tokens=False)
    clip = _clip(7, 2, size=(320, 200))  # large enough to be resized
    whole = proc.expand(ids, [_image()], [clip])
    pool = _PlanningPool()
    monkeypatch.setattr(proc, "decoder", pool)
    planned = proc.expand(ids, [_image()], [clip])
    (_, h, w) = whole.mm_inputs[1].data.grid_thw  # type: ignore[attr-defined]
    size = (h * 16, w * 16)
    assert size != (200, 320) and pool.calls == ["plan", f"load {size}"]
    assert planned.token_ids == whole.token_ids
    assert torch.equal(planned.mrope_positions, whole.mrope_positions)
    for a, b in zip(planned.mm_inputs, whole.mm_inputs, strict=True):
        assert a.placeholder == b.placeholder
        assert torch.equal(a.data.pixel_values, b.data.pixel_values)  # type: ignore[attr-defined]
    pool.calls.clear()
    monkeypatch.setattr(proc, "max_model_len", len(whole.token_ids) - 1)
    with pytest.raises(PromptTooLongError, match=r"video 0: its \d+ tokens"):
        proc.expand(ids, [_image()], [clip])
    assert pool.calls == ["plan"]  # nothing decoded


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 24])
def test_generation_equals_transformers(
    qwen3_dir: Path, qwen3_model: torch.nn.Module, max_num_batched_tokens: int
) -> None:
    """An image and a timestamped video through the whole engine (per-group inputs, the encoder cache,
    DeepStack in the decoder; 24: chunked prefill, groups encoded as their chunks arrive) give the greedy
    tokens of transformers' generate on the same ids and pixels."""
    from mmserve.encoders.media import load_video
    from mmserve.encoders.preprocess import load_preprocess_configs, preprocess_image, preprocess_video
    from mmserve.engine.llm import LLM
    from mmserve.request import SamplingParams

    clip, image = _clip(7, 2), _image()
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", max_num_batched_tokens=max_num_batched_tokens)
    try:
        prompt = {"prompt": PROMPT, "images": [image], "videos": [clip]}
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        ours = llm.generate(prompt, params)[0].token_ids
        request, _ = llm.processor.process(prompt, params, "ref")
        limits = llm.processor.mm_processor.video_limits  # type: ignore[union-attr]
    finally:
        llm.close()
    image_cfg, video_cfg = load_preprocess_configs(qwen3_dir, "qwen3_vl")
    img = preprocess_image(image, image_cfg)
    vid = preprocess_video(load_video(clip, limits).frames, video_cfg)
    cfg = qwen3_model.config
    ids = torch.tensor([request.prompt_token_ids])
    types = [1 if t == cfg.image_token_id else 2 if t == cfg.video_token_id else 0 for t in request.prompt_token_ids]
    with torch.inference_mode():
        out = qwen3_model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=torch.tensor([types]),
            pixel_values=img.pixel_values, image_grid_thw=torch.tensor([img.grid_thw]),
            pixel_values_videos=vid.pixel_values, video_grid_thw=torch.tensor([vid.grid_thw]),
            max_new_tokens=8, min_new_tokens=8, do_sample=False,
        )  # fmt: skip
    assert list(ours) == out[0, ids.shape[1] :].tolist()


def test_planned_short_clip_gets_min_frames(mm, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3VLVideoProcessor samples at least min_frames (4): a 1 s clip at 8 fps gives 4 frames, not 2."""
    proc, tok = mm
    ids = tok.encode("<|vision_start|><|video_pad|><|vision_end|>")
    pool = _PlanningPool()
    monkeypatch.setattr(proc, "decoder", pool)
    out = proc.expand(ids, [], [_clip(8, 8)])
    assert pool.calls[:2] == ["plan", "plan"] and len(out.mm_inputs) == 2  # 4 frames, 2 groups
    pool.calls.clear()
    four = proc.expand(ids, [], [_clip(16, 8)])  # 2 s at 2 fps: 4 frames already, planned once
    assert len(four.mm_inputs) == 2 and pool.calls.count("plan") == 1
