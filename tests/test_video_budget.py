"""A video's plan (frame count, size, rates) from its container headers, before any frame is decoded, and
`load_video` keeping to it exactly; `resize_to` resizing each frame as preprocessing would, bit for bit."""

from __future__ import annotations

import io
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from mmserve.encoders import media
from mmserve.encoders.decode_pool import DecodePool
from mmserve.encoders.media import MediaLimits, VideoPlan, load_video, plan_video
from mmserve.encoders.preprocess import VisionPreprocessConfig, preprocess_video, resized_size
from mmserve.errors import InvalidRequestError


def make_clip(
    num_frames: int,
    fps: float | Fraction,
    size: tuple[int, int] = (64, 48),
    *,
    codec: str = "libx264",
    fmt: str = "mp4",
    rotation: int | None = None,
) -> bytes:
    """Frame i: a left-to-right gradient shifted by i (so resizing has detail to work on), frame index in
    the grey level of its bottom rows, top rows red (orientation)."""
    buf = io.BytesIO()
    w, h = size
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "0", "preset": "ultrafast"}
        if rotation is not None:
            stream.set_display_rotation(rotation)
        ramp = (np.arange(w) * 255 // max(1, w - 1)).astype(np.uint8)
        for i in range(num_frames):
            rgb = np.empty((h, w, 3), np.uint8)
            rgb[:] = np.roll(ramp, i)[None, :, None]
            rgb[:4] = (255, 0, 0)
            rgb[-8:] = 8 * i % 256
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


# name -> encoded clip; every one small (64x48 to 96x64, 1-4 s).
CLIP_SPECS = {
    "mp4-h264-10fps-3s": dict(num_frames=30, fps=10),
    "mp4-h264-29.97fps-2s": dict(num_frames=60, fps=Fraction(30000, 1001), size=(96, 64)),
    "mp4-h264-25fps-4s-wide": dict(num_frames=100, fps=25, size=(96, 48)),
    "mp4-h264-3-frames-1fps": dict(num_frames=3, fps=1),
    "mp4-h264-1-frame": dict(num_frames=1, fps=10),
    "mp4-h264-rotated-90": dict(num_frames=12, fps=6, size=(80, 48), rotation=90),
    "mkv-h264-12fps": dict(num_frames=24, fps=12, size=(80, 48), fmt="matroska"),
    "webm-vp9-8fps": dict(num_frames=16, fps=8, codec="libvpx-vp9", fmt="webm"),
    "avi-mpeg4-10fps": dict(num_frames=20, fps=10, codec="mpeg4", fmt="avi"),
}
LIMITS = {
    "default": MediaLimits(),
    "5fps": MediaLimits(video_fps=5.0),
    "0.7fps": MediaLimits(video_fps=0.7),
    "cap-5": MediaLimits(max_video_frames=5),  # longer than 5 frames allow at 2 fps: spread out
    "cap-1": MediaLimits(max_video_frames=1),
    "30fps-cap-7": MediaLimits(video_fps=30.0, max_video_frames=7),
}


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    return {name: make_clip(**spec) for name, spec in CLIP_SPECS.items()}


@pytest.fixture(scope="module")
def pool() -> Iterator[DecodePool]:
    pool = DecodePool(workers=1, timeout_s=30.0, memory_mib=1024)
    yield pool
    pool.close()


class Counter:
    """Counts frames decoded and frames converted to RGB, through media.py's own functions."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decoded = self.converted = 0
        decode_frames, frame_to_rgb = media._decode_frames, media._frame_to_rgb

        def counted_decode(container: av.container.InputContainer, stream: av.VideoStream) -> Iterator:
            for frame in decode_frames(container, stream):
                self.decoded += 1
                yield frame

        def counted_convert(*args: object) -> np.ndarray:
            self.converted += 1
            return frame_to_rgb(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(media, "_decode_frames", counted_decode)
        monkeypatch.setattr(media, "_frame_to_rgb", counted_convert)


def assert_plan_matches(plan: VideoPlan, video: media.DecodedVideo, case: object) -> None:
    assert plan.num_frames == video.num_frames, case
    assert (plan.height, plan.width) == video.frames.shape[1:3], case
    assert (plan.fps, plan.source_fps, plan.duration_s) == (video.fps, video.source_fps, video.duration_s), (
        case
    )


# ------------------------------------------------------------------------------------------- the plan


def test_plan_is_what_load_video_returns(clips: dict[str, bytes]) -> None:
    for name, data in clips.items():
        for limits_name, limits in LIMITS.items():
            assert_plan_matches(plan_video(data, limits), load_video(data, limits), (name, limits_name))


def test_plan_of_notable_clips(clips: dict[str, bytes]) -> None:
    plan = plan_video(clips["mp4-h264-10fps-3s"])
    assert (plan.num_frames, plan.fps, plan.source_fps, plan.width, plan.height) == (6, 2.0, 10.0, 64, 48)
    assert plan.duration_s == pytest.approx(3.0) and plan.timestamps_s is None
    capped = plan_video(clips["mp4-h264-25fps-4s-wide"], LIMITS["cap-5"])  # 8 frames at 2 fps, 5 allowed
    assert capped.num_frames == 5 and capped.fps == pytest.approx(5 / 4)
    odd = plan_video(clips["mp4-h264-29.97fps-2s"])
    assert odd.source_fps == pytest.approx(29.97, abs=1e-3) and odd.num_frames == 4
    assert plan_video(clips["mp4-h264-3-frames-1fps"]).num_frames == 3  # never faster than the source
    assert plan_video(clips["mp4-h264-1-frame"]).num_frames == 1
    rotated = plan_video(clips["mp4-h264-rotated-90"])
    assert (rotated.width, rotated.height) == (48, 80)  # upright, as load_video returns it


def test_plan_decodes_no_frame_where_the_headers_suffice(
    clips: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = Counter(monkeypatch)
    for name in ("mp4-h264-10fps-3s", "mp4-h264-29.97fps-2s", "mp4-h264-25fps-4s-wide", "avi-mpeg4-10fps"):
        plan_video(clips[name], LIMITS["5fps"])
        assert (counter.decoded, counter.converted) == (0, 0), name
    # A rotated mp4 or a Matroska file: the first frame says the upright size; none is converted.
    for name in ("mp4-h264-rotated-90", "mkv-h264-12fps", "webm-vp9-8fps"):
        counter.decoded = 0
        plan_video(clips[name])
        assert (counter.decoded, counter.converted) == (1, 0), name
    counter.decoded = 0
    video = load_video(clips["mp4-h264-10fps-3s"])  # the hook does see load_video's decoding
    assert counter.decoded > 0 and counter.converted == video.num_frames == 6


def test_a_stream_shorter_than_its_header_still_gives_the_planned_count(
    clips: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Targets past the last frame hold that frame: the count never falls short of the plan."""
    data = clips["mp4-h264-10fps-3s"]
    plan = plan_video(data)
    decode_frames = media._decode_frames

    def first_12(container: av.container.InputContainer, stream: av.VideoStream) -> Iterator:
        for i, frame in enumerate(decode_frames(container, stream)):
            if i == 12:
                return
            yield frame

    monkeypatch.setattr(media, "_decode_frames", first_12)  # as if the file ended at 1.2 s
    video = load_video(data)
    assert video.num_frames == plan.num_frames == 6
    assert np.array_equal(video.frames[3:], np.repeat(video.frames[2:3], 3, axis=0))  # frame 10 (1.0 s) held
    assert video.timestamps_s == pytest.approx((0.0, 0.5, 1.0, 1.0, 1.0, 1.0))


def test_array_plan_is_its_shape() -> None:
    frames = np.zeros((5, 8, 10, 3), np.uint8)
    plan = plan_video(frames, array_fps=5.0)
    assert (plan.num_frames, plan.height, plan.width, plan.fps, plan.duration_s) == (5, 8, 10, 5.0, 1.0)
    assert plan.timestamps_s == pytest.approx((0.0, 0.2, 0.4, 0.6, 0.8))
    with pytest.raises(InvalidRequestError, match="max_video_frames"):
        plan_video(frames, MediaLimits(max_video_frames=4))


def bad_cases(clips: dict[str, bytes], tmp_path: Path) -> list[tuple[object, MediaLimits]]:
    clip = clips["mp4-h264-10fps-3s"]
    return [
        (b"\x00" * 5000, MediaLimits()),  # not a video format
        (clip[: len(clip) // 2], MediaLimits()),  # truncated: the moov index is at the end
        (clip[:64], MediaLimits()),
        (b"", MediaLimits()),
        ("data:video/mp4;base64,!!", MediaLimits()),
        (str(tmp_path / "missing.mp4"), MediaLimits()),
        ("http://example.com/a.mp4", MediaLimits()),
        (clip, MediaLimits(max_video_duration_s=2.0)),
        (clip, MediaLimits(max_video_bytes=1000)),
        (clip, MediaLimits(max_video_pixels_per_frame=64 * 48 - 1)),
        (clips["mkv-h264-12fps"], MediaLimits(max_video_pixels_per_frame=100)),
    ]


def message(fn) -> str:
    with pytest.raises(InvalidRequestError) as info:
        fn()
    assert info.value.param == "videos"
    return str(info.value)


def test_bad_files_fail_in_the_plan_as_in_load_video(
    clips: dict[str, bytes], tmp_path: Path, pool: DecodePool
) -> None:
    kw = dict(item="video 1", param="videos")
    for source, limits in bad_cases(clips, tmp_path):
        expected = message(lambda s=source, lim=limits: load_video(s, lim, **kw))
        assert expected.startswith("video 1: ")
        assert message(lambda s=source, lim=limits: plan_video(s, lim, **kw)) == expected, source
        assert message(lambda s=source, lim=limits: pool.plan_video(s, lim, **kw)) == expected, source


# ---------------------------------------------------------------------------------------- resize_to


def pil_resize(frames: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    h, w = size
    return np.stack([np.asarray(Image.fromarray(f).resize((w, h), resample=resample)) for f in frames])


@pytest.mark.parametrize("resample", [3, 2, 1])
def test_resize_to_is_decode_then_pil_resize_bit_for_bit(clips: dict[str, bytes], resample: int) -> None:
    for name in ("mp4-h264-29.97fps-2s", "mp4-h264-rotated-90", "webm-vp9-8fps"):
        full = load_video(clips[name])
        for size in ((28, 56), (56, 28), (100, 150), full.frames.shape[1:3]):  # down, squashed, up, same
            resized = load_video(clips[name], resize_to=size, resample=resample)
            assert resized.frames.shape == (full.num_frames, *size, 3), (name, size)
            assert np.array_equal(resized.frames, pil_resize(full.frames, size, resample)), (name, size)
            assert (resized.fps, resized.timestamps_s) == (full.fps, full.timestamps_s)


def test_preprocessing_resized_frames_gives_the_same_pixel_values(clips: dict[str, bytes]) -> None:
    """The caller's path: plan -> resized_size -> load_video(resize_to) -> preprocess_video, which finds the
    frames at size and does not resize again, gives exactly what decoding at full size would."""
    cfg = VisionPreprocessConfig(modality="video", min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    for name in ("mp4-h264-29.97fps-2s", "mp4-h264-rotated-90"):
        plan = plan_video(clips[name])
        size = resized_size(plan.height, plan.width, cfg, num_frames=plan.num_frames)
        assert size != (plan.height, plan.width)  # a real downscale
        early = preprocess_video(load_video(clips[name], resize_to=size).frames, cfg)
        late = preprocess_video(load_video(clips[name]).frames, cfg)
        assert early.grid_thw == late.grid_thw and early.num_embeds == late.num_embeds
        assert bool((early.pixel_values == late.pixel_values).all()), name


def test_resize_of_an_array_source_and_bad_arguments() -> None:
    frames = np.random.default_rng(0).integers(0, 256, (3, 20, 30, 3), dtype=np.uint8)
    video = load_video(frames, resize_to=(10, 14))
    assert np.array_equal(video.frames, pil_resize(frames, (10, 14), 3))
    for bad in ((0, 10), (10,), (10.0, 12), "10x12"):
        with pytest.raises(ValueError, match="resize_to"):
            load_video(frames, resize_to=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="resample"):
        load_video(frames, resize_to=(10, 14), resample=9)


def test_no_full_size_frame_is_stored(clips: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every converted frame is resized before the next one is decoded (at most one full-size frame lives)."""
    sizes: list[tuple[int, ...]] = []
    resize = media._resize

    def recorded(rgb: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
        out = resize(rgb, size, resample)
        sizes.append(out.shape)
        return out

    monkeypatch.setattr(media, "_resize", recorded)
    video = load_video(clips["mp4-h264-25fps-4s-wide"], MediaLimits(video_fps=5.0), resize_to=(24, 32))
    assert video.frames.shape == (20, 24, 32, 3) and sizes == [(24, 32, 3)] * 20


# ------------------------------------------------------------------------------------------- the pool


def test_pool_plans_and_resizes_as_in_process(
    clips: dict[str, bytes], pool: DecodePool, tmp_path: Path
) -> None:
    for name in ("mp4-h264-29.97fps-2s", "mp4-h264-rotated-90", "mkv-h264-12fps", "mp4-h264-1-frame"):
        for limits in (LIMITS["default"], LIMITS["cap-5"]):
            plan = pool.plan_video(clips[name], limits)
            assert plan == plan_video(clips[name], limits), name
            assert_plan_matches(plan, pool.load_video(clips[name], limits), name)
            size = (plan.height // 2 + 1, plan.width // 3 + 2)
            isolated = pool.load_video(clips[name], limits, resize_to=size)
            local = load_video(clips[name], limits, resize_to=size)
            assert isolated.frames.shape == (plan.num_frames, *size, 3), name
            assert np.array_equal(isolated.frames, local.frames), name
    path = tmp_path / "clip.bin"
    path.write_bytes(clips["webm-vp9-8fps"])
    assert pool.plan_video(path, LIMITS["default"]) == plan_video(path)
    frames = np.zeros((4, 8, 10, 3), np.uint8)
    assert pool.plan_video(frames, LIMITS["default"], array_fps=4.0) == plan_video(frames, array_fps=4.0)
    assert pool.load_video(frames, LIMITS["default"], resize_to=(4, 5)).frames.shape == (4, 4, 5, 3)
    assert pool.num_replaced == 0
