"""The demo model's data: easy-vqa's shape images and questions (MIT, shipped inside the `easy-vqa` wheel),
plus short clips of one easy-vqa-style shape moving across the frame, with questions about its shape,
its colour and which way it moves.

Clips are rendered here, encoded as H.264 mp4 and decoded again through mmserve's own video loader, so the
model trains on exactly the frames the server will hand it.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import av
import numpy as np
from PIL import Image, ImageDraw

from mmserve.encoders.media import load_video

Split = Literal["train", "test"]
SHAPES = ("circle", "rectangle", "triangle")
# easy-vqa's palette (read from its images).
COLORS = {
    "red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "black": (0, 0, 0),
    "gray": (128, 128, 128), "teal": (0, 128, 128), "brown": (165, 42, 42), "yellow": (255, 255, 0),
}  # fmt: skip
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
CLIP_SIZE = 64  # px, as easy-vqa's images
CLIP_FRAMES = 8
CLIP_FPS = 2.0  # the server samples videos at 2 fps, so every frame of a clip is kept
_SUPERSAMPLE = 4  # shapes are drawn 4x larger and shrunk: antialiased edges like easy-vqa's


@dataclass(frozen=True)
class Question:
    text: str
    answer: str
    media_id: int  # index into the split's images or clips


@dataclass(frozen=True)
class Clip:
    shape: str
    color: str
    direction: str
    mp4: bytes  # H.264, CLIP_FRAMES frames at CLIP_FPS
    frames: np.ndarray  # [CLIP_FRAMES, CLIP_SIZE, CLIP_SIZE, 3] uint8: `mp4` decoded by mmserve's loader


def easy_vqa_questions(split: Split) -> list[Question]:
    import easy_vqa

    texts, answers, image_ids = (
        easy_vqa.get_train_questions() if split == "train" else easy_vqa.get_test_questions()
    )
    return [Question(t, a, i) for t, a, i in zip(texts, answers, image_ids, strict=True)]


def easy_vqa_image_paths(split: Split) -> dict[int, str]:
    import easy_vqa

    return easy_vqa.get_train_image_paths() if split == "train" else easy_vqa.get_test_image_paths()


def load_easy_vqa_images(split: Split, image_ids: list[int] | None = None) -> dict[int, np.ndarray]:
    """image id -> [64, 64, 3] uint8, for `image_ids` (default: every image of the split)."""
    paths = easy_vqa_image_paths(split)
    return {i: np.asarray(Image.open(paths[i]).convert("RGB")) for i in (paths if image_ids is None else image_ids)}


def video_questions(clip: Clip, rng: random.Random) -> list[tuple[str, str]]:
    """(question, answer) pairs about one clip: two of each kind, phrasings drawn from `rng`."""
    shape, color, direction = clip.shape, clip.color, clip.direction
    other = rng.choice([d for d in DIRECTIONS if d != direction])
    asked = rng.choice((direction, other))
    kinds = [
        [("what shape is moving?", shape), ("what shape is in the video?", shape),
         (f"what is the moving {color} shape?", shape), ("which shape moves?", shape)],
        [("what color is the shape?", color), ("what color is the moving shape?", color),
         (f"what is the color of the moving {shape}?", color)],
        [("which way is the shape moving?", direction), ("which direction does the shape move?", direction),
         (f"where is the {color} {shape} going?", direction), (f"which way does the {shape} move?", direction)],
        [(f"is the shape moving {asked}?", "yes" if asked == direction else "no"),
         (f"does the {shape} move {asked}?", "yes" if asked == direction else "no")],
    ]  # fmt: skip
    return [pair for kind in kinds for pair in rng.sample(kind, 1)]


# easy-vqa's own yes/no phrasings, and whether each is negated; "{}" is a shape or "<colour> shape".
_YES_NO_TEMPLATES = (
    ("is there a {}?", False), ("is there a {} in the image?", False), ("does the image contain a {}?", False),
    ("is a {} present?", False), ("is there not a {}?", True), ("is there not a {} in the image?", True),
    ("does the image not contain a {}?", True), ("is no {} present?", True),
)  # fmt: skip
# balanced_yes_no's `form`: what the questions ask about (colour, shape or both) and in which phrasings
# ("is there a ...?" only, easy-vqa's four un-negated ones, or all eight).
YES_NO_FORMS = {
    "color": ("color", 1), "color-plain": ("color", 4), "color-all": ("color", 8),
    "shape": ("shape", 1), "shape-all": ("shape", 8), "all": ("both", 8),
}  # fmt: skip


def balanced_yes_no(
    shape: str, color: str, rng: random.Random, n: int, form: str = "all"
) -> list[tuple[str, str]]:
    """`n` yes/no questions, in easy-vqa's phrasings, about an image of one `color` `shape`; each names
    what the image shows with probability 1/2. easy-vqa's own mostly name something absent (86% of its
    un-negated colour questions answer "no"), and a model trained on them alone answers from the
    question's form (negated: "yes", else "no") without looking at the image.

    `form` (YES_NO_FORMS) narrows the questions for train-demo's yes/no stage, e.g. "color" only asks
    "is there a <colour> shape?", "all" asks about colour or shape in any of the eight phrasings."""
    about, num_phrasings = YES_NO_FORMS[form]
    templates = _YES_NO_TEMPLATES[:num_phrasings]  # the un-negated ones come first
    out = []
    for _ in range(n):
        template, negated = rng.choice(templates)
        shown = rng.random() < 0.5
        if about == "color" or (about == "both" and rng.random() < 0.5):
            thing = f"{color if shown else rng.choice([c for c in COLORS if c != color])} shape"
        else:
            thing = shape if shown else rng.choice([s for s in SHAPES if s != shape])
        out.append((template.format(thing), "yes" if shown != negated else "no"))
    return out


def direction_yes_no(clip: Clip, rng: random.Random) -> list[tuple[str, str]]:
    """Two yes/no questions about a clip's direction: one names it (yes), one names another (no)."""
    other = rng.choice([d for d in DIRECTIONS if d != clip.direction])
    templates = ("is the shape moving {}?", f"does the {clip.shape} move {{}}?")
    return [(rng.choice(templates).format(clip.direction), "yes"), (rng.choice(templates).format(other), "no")]


def make_clips(n: int, seed: int) -> list[Clip]:
    """`n` clips, each one shape of easy-vqa's palette moving steadily in one of four directions."""
    rng = random.Random(seed)
    return [_render_clip(rng) for _ in range(n)]


def _render_clip(rng: random.Random) -> Clip:
    shape, color, direction = rng.choice(SHAPES), rng.choice(list(COLORS)), rng.choice(list(DIRECTIONS))
    size = rng.randint(14, 22)  # the shape's extent in px
    speed = rng.uniform(2.5, 4.0)  # px per frame
    travel = speed * (CLIP_FRAMES - 1)
    dx, dy = DIRECTIONS[direction]
    margin = 2

    def start(axis_dir: int) -> float:
        if axis_dir > 0:
            return rng.uniform(margin, CLIP_SIZE - margin - size - travel)
        if axis_dir < 0:
            return rng.uniform(margin + travel, CLIP_SIZE - margin - size)
        return rng.uniform(margin, CLIP_SIZE - margin - size)

    x0, y0 = start(dx), start(dy)
    background = tuple(rng.randint(225, 255) for _ in range(3))
    aspect = rng.uniform(0.6, 1.0) if shape == "rectangle" else 1.0
    frames = []
    for k in range(CLIP_FRAMES):
        x, y = x0 + dx * speed * k, y0 + dy * speed * k
        frames.append(_draw(shape, COLORS[color], background, x, y, size, aspect))
    mp4 = encode_mp4(np.stack(frames), CLIP_FPS)
    decoded = load_video(mp4).frames
    return Clip(shape, color, direction, mp4, decoded)


def _draw(
    shape: str, rgb: tuple[int, int, int], background: tuple[int, ...], x: float, y: float, size: int, aspect: float
) -> np.ndarray:
    s = _SUPERSAMPLE
    img = Image.new("RGB", (CLIP_SIZE * s, CLIP_SIZE * s), background)
    draw = ImageDraw.Draw(img)
    x0, y0, w = x * s, y * s, size * s
    if shape == "circle":
        draw.ellipse((x0, y0, x0 + w, y0 + w), fill=rgb)
    elif shape == "rectangle":
        h = w * aspect
        draw.rectangle((x0, y0 + (w - h) / 2, x0 + w, y0 + (w + h) / 2), fill=rgb)
    else:
        draw.polygon([(x0 + w / 2, y0), (x0 + w, y0 + w * math.sqrt(3) / 2), (x0, y0 + w * math.sqrt(3) / 2)],
                     fill=rgb)  # fmt: skip
    return np.asarray(img.resize((CLIP_SIZE, CLIP_SIZE), Image.Resampling.LANCZOS))


def encode_mp4(frames: np.ndarray, fps: float) -> bytes:
    """[T, H, W, 3] uint8 -> H.264 mp4 bytes (yuv420p, near-lossless)."""
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=round(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "12", "preset": "veryfast"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def tokenizer_corpus(rng: random.Random) -> Iterator[str]:
    """Every question and answer the model trains on, the chat template's fixed text, and some general
    English-like text so that other prompts still tokenize into word pieces rather than bytes."""
    from mmserve.tiny_model import english_like_corpus

    for _ in range(1000):  # the template's own words: each becomes one token
        yield "system\nYou are a helpful assistant.\nuser\nassistant\n"
    yield from english_like_corpus(3000)
    for question in easy_vqa_questions("train"):
        yield question.text
        yield question.answer
    for _ in range(2000):
        clip = Clip(rng.choice(SHAPES), rng.choice(list(COLORS)), rng.choice(list(DIRECTIONS)), b"", np.empty(0))
        for text, answer in video_questions(clip, rng):
            yield text
            yield answer
