"""Regenerates the sample media in assets/ from scikit-image's bundled CC0 photos (see assets/README.md).

Run: `.venv/bin/python assets/make_assets.py` (needs the `test` extra). Not imported by mmserve.
"""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
from PIL import Image
from skimage import data

HERE = Path(__file__).parent
CLIP_FPS = 10
CLIP_SECONDS = 3
CLIP_SIZE = (320, 240)  # (width, height); even sides for yuv420p


def make_photo(path: Path) -> None:
    """scikit-image's `chelsea` (451x300, CC0) as a baseline JPEG."""
    Image.fromarray(data.chelsea()).save(path, format="JPEG", quality=95, optimize=True)


def make_clip(path: Path) -> None:
    """A 3 s, 10 fps H.264 pan and zoom across scikit-image's `coffee` photo (600x400, CC0)."""
    photo = Image.fromarray(data.coffee())
    w, h = CLIP_SIZE
    n = CLIP_FPS * CLIP_SECONDS
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=CLIP_FPS)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"crf": "26", "preset": "slow", "tune": "film"}
        for i in range(n):
            s = i / (n - 1)  # 0 -> 1 over the clip
            crop_w = 480 - 160 * s  # zoom in from 480x360 to 320x240
            crop_h = crop_w * h / w
            left = (photo.width - crop_w) * s
            top = (photo.height - crop_h) * (0.5 - 0.4 * s)
            box = (left, top, left + crop_w, top + crop_h)
            frame = np.asarray(photo.resize((w, h), Image.Resampling.BICUBIC, box=box))
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


if __name__ == "__main__":
    make_photo(HERE / "sample.jpg")
    make_clip(HERE / "sample_clip.mp4")
    for name in ("sample.jpg", "sample_clip.mp4"):
        print(name, (HERE / name).stat().st_size, "bytes")
