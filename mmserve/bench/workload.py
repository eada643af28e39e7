"""The requests every `mmserve bench` command sends: online `Request`s (OpenAI chat messages) and offline
`Workload`s (token ids as the engine sees them), with their random text (decoded random ids, or words),
images (random pixels) and videos (smooth drifting colour fields: small to send)."""

from __future__ import annotations

import base64
import io
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmserve.bench import MixConfig, ServeBenchConfig, ThroughputBenchConfig

INTERACTIVE, BATCH = "interactive", "batch"  # service classes (slo-mix): service_tier default / flex
_WORDS = (
    "the a red blue green circle square image video frame token cache block decode prefill model "
    "server request stream latency batch of in on with and to is what why how describe count"
).split()
# How a request's output length is forced on a server: vLLM's `ignore_eos`, or (transformers serve, which
# refuses unknown fields) transformers' `min_new_tokens` in the request's `generation_config`.
LENGTH_FORCINGS = ("ignore_eos", "generation_config")
VIDEO_OUTPUT_LEN = 8  # long-video: tokens each video request generates (a short answer)


def load_tokenizer(model: Path | None) -> Any | None:
    if model is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def random_text(rng: random.Random, n: int, tokenizer: Any | None) -> str:
    """About `n` prompt tokens: decoded random ids when a tokenizer is at hand, else random words."""
    if tokenizer is None:
        return " ".join(rng.choice(_WORDS) for _ in range(n))
    ids = [rng.randrange(100, max(101, len(tokenizer) - 300)) for _ in range(n)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def random_pixels(rng: np.random.Generator, size: int) -> np.ndarray:
    return rng.integers(0, 255, (size, size, 3), dtype=np.uint8)  # [H, W, 3]


def _image_bytes(pixels: np.ndarray, image_format: str = "png") -> bytes:
    """[H, W, 3] uint8 as PNG (lossless: every pixel as drawn) or JPEG (quality 90) bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=image_format.upper(), quality=90)  # PNG ignores the quality
    return buf.getvalue()


def image_data_url(rng: np.random.Generator, size: int, image_format: str = "png") -> str:
    """A random `size`^2 image as a data URL, PNG or JPEG (see `_image_bytes`)."""
    data = _image_bytes(random_pixels(rng, size), image_format)
    return f"data:image/{image_format};base64," + base64.b64encode(data).decode()


def video_frames(rng: np.random.Generator, num_frames: int, size: int) -> np.ndarray:
    """[T, size, size, 3] uint8: smooth colour fields that drift frame to frame (a random start), so a clip
    encodes small."""
    base = rng.integers(0, 255, 3)
    ramp = np.linspace(0, 255, size, dtype=np.float64)
    t = np.arange(num_frames, dtype=np.float64)[:, None, None]
    channels = [(ramp[None, None, :] + ramp[None, :, None] * (c + 1) / 3 + base[c] + 9 * t) % 256 for c in range(3)]
    return np.stack(channels, axis=-1).astype(np.uint8)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def media_parts(np_rng: np.random.Generator, images: int = 0, image_size: int = 0, frames: int = 0,
                video_size: int = 0, image_format: str = "png") -> list[dict]:  # fmt: skip
    """`images` fresh random images, then (frames > 0) one fresh video (`video_frames` as an H.264 mp4 at the
    server's sampling rate: every frame is kept), as data-URL content parts."""
    parts = [image_part(image_data_url(np_rng, image_size, image_format)) for _ in range(images)]
    if frames:  # PyAV only when a video is drawn
        from mmserve.demo.data import encode_mp4
        from mmserve.encoders.media import DEFAULT_LIMITS

        mp4 = encode_mp4(video_frames(np_rng, frames, video_size), DEFAULT_LIMITS.video_fps)
        url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
        parts.append({"type": "video_url", "video_url": {"url": url}})
    return parts


def user(text: str, media: list[dict] | None = None) -> list[dict]:
    """The messages of a one-turn chat: the user's `media` parts then `text` (without media: the bare text)."""
    return [{"role": "user", "content": [*media, text_part(text)] if media else text}]


def _check_media(num_images: int, num_frames: int) -> None:
    if num_images < 0 or num_frames < 0 or num_images + num_frames == 0:
        raise ValueError("random-mm needs images (--num-images) or a video (--num-frames), none negative")


@dataclass(frozen=True)
class Request:
    """One chat request as a client sends it."""

    messages: list[dict]
    output_len: int  # max_tokens, forced (ignore_eos)
    service_class: str = INTERACTIVE  # BATCH: sent with service_tier "flex" and priority 1
    kind: str = "text"  # what it carries: text | image | long-text | multi-image | video
    at_s: float | None = None  # send offset from the phase's start; None: the run's arrival process decides
    # long-video's videos: sent once every other request streams, `video_interval_s` apart (load.run_requests)
    late: bool = False

    def body(self, length_forcing: str = "ignore_eos") -> dict[str, Any]:
        """The chat body (greedy, its length forced as `length_forcing` says: one of LENGTH_FORCINGS). The
        class marks are sent only for slo-mix's classes: fcfs ignores both, priority reads `priority`, slo
        `service_tier`."""
        body = {"messages": self.messages, "max_tokens": self.output_len, "temperature": 0.0}
        if length_forcing == "ignore_eos":  # vLLM's field (mmserve, vLLM, SGLang, llama.cpp's server)
            body["ignore_eos"] = True
        elif length_forcing == "generation_config":  # `transformers serve`, which refuses ignore_eos
            body["generation_config"] = json.dumps({"min_new_tokens": self.output_len})
        else:
            raise ValueError(f"length_forcing: choose from {', '.join(LENGTH_FORCINGS)} (got {length_forcing!r})")
        if self.at_s is not None:  # a phase of classed requests (slo-mix)
            batch = self.service_class == BATCH
            body |= {"service_tier": "flex" if batch else "default", "priority": 1 if batch else 0}
        return body


def build_requests(cfg: ServeBenchConfig, seed: int, tokenizer: Any | None = None) -> list[Request]:
    """`cfg.workload`'s requests (`cfg` resolved: its images and frames per prompt filled in). `random`: text
    prompts of random length; `random-mm`: the same, each with `num_images` random images of `image_size`^2
    pixels and (num_frames > 0) one mp4 of `num_frames` random `video_size`^2 frames, as data URLs (distinct
    per request: no cache hits); `prefix`: every prompt starts with the same `num_images` images (the same
    pixels, so one mm_hash each: encoder- and prefix-cache hits), then the same text of about `prefix_len`
    tokens, then a random text of its own; `long-video`: the `random` text prompts, then `num_videos` requests
    of one video each (`num_frames` frames and a short question, VIDEO_OUTPUT_LEN tokens out), marked `late`:
    they arrive while the texts decode."""
    workload, num_images, num_frames = cfg.workload, cfg.num_images or 0, cfg.num_frames or 0
    if workload == "random-mm":
        _check_media(num_images, num_frames)
    if workload == "prefix" and num_images < 0:
        raise ValueError("prefix: --num-images must not be negative")
    if workload == "long-video" and (cfg.num_videos < 1 or num_frames < 1):
        raise ValueError("long-video needs --num-videos and --num-frames >= 1")
    rng, np_rng, video_size = random.Random(seed), np.random.default_rng(seed), cfg.video_size or 112
    prefix = random_text(rng, cfg.prefix_len, tokenizer) + "\n" if workload == "prefix" else ""
    shared: list[dict] = []  # prefix: one set of images, in front of every prompt (the same data URLs: the same pixels)
    if workload == "prefix":
        shared = media_parts(np_rng, num_images, cfg.image_size, image_format=cfg.image_format)
    out = []
    for _ in range(cfg.num_prompts):
        text = prefix + random_text(rng, rng.randint(*cfg.input_len), tokenizer)
        media = (media_parts(np_rng, num_images, cfg.image_size, num_frames, video_size, cfg.image_format)
                 if workload == "random-mm" else shared)  # fmt: skip
        out.append(Request(user(text, media), rng.randint(*cfg.output_len)))
    for j in range(cfg.num_videos if workload == "long-video" else 0):
        video = media_parts(np_rng, frames=num_frames, video_size=video_size)
        out.append(Request(user(f"What happens in clip {j}?", video), VIDEO_OUTPUT_LEN, late=True))
    return out


def build_mix(cfg: MixConfig, load: float, seed: int, tokenizer: Any | None) -> list[Request]:
    """The batch backlog (all at offset 0: long text, multi-image and video jobs in turn) then the chats at
    Poisson offsets within `duration_s`."""
    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    out = []
    for i in range(cfg.num_batch):
        kind = ("long-text", "multi-image", "video")[i % 3]
        # drawn for every job (long-text uses it), so a seed's jobs stay as they were
        text = "Summarise this document.\n" + random_text(rng, rng.randint(*cfg.batch_input_len), tokenizer)
        media: list[dict] = []
        if kind == "multi-image":
            text, media = "Compare these images.", media_parts(np_rng, cfg.batch_images, cfg.image_size)
        elif kind == "video":
            text = "Describe what happens in the video."
            media = media_parts(np_rng, frames=cfg.video_frames, video_size=cfg.video_size)
        out.append(Request(user(text, media), rng.randint(*cfg.batch_output_len), BATCH, kind, at_s=0.0))
    t = float(np_rng.exponential(1.0 / load))
    while t < cfg.duration_s:
        out.append(_chat(cfg, rng, np_rng, tokenizer, t))
        t += float(np_rng.exponential(1.0 / load))
    return out


def build_chats(cfg: MixConfig, n: int, seed: int, tokenizer: Any | None) -> list[Request]:
    """`n` chats of the mix's shapes, all at offset 0."""
    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    return [_chat(cfg, rng, np_rng, tokenizer, 0.0) for _ in range(n)]


def _chat(cfg: MixConfig, rng: random.Random, np_rng: np.random.Generator, tokenizer: Any | None,
          at_s: float) -> Request:  # fmt: skip
    text = random_text(rng, rng.randint(*cfg.chat_input_len), tokenizer)
    images = int(rng.random() < cfg.chat_image_share)  # a chat is text, or one image and text
    media = media_parts(np_rng, images, cfg.image_size)
    return Request(user(text, media), rng.randint(*cfg.chat_output_len), INTERACTIVE, "image" if images else "text",
                   at_s=at_s)  # fmt: skip


_IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
_VIDEO_MARK = "<|vision_start|><|video_pad|><|vision_end|>"


def image_prompt(size: int, seed: int) -> dict:
    """One random image as a PNG, as a client sends it (bytes to decode), with a short question."""
    pixels = random_pixels(np.random.default_rng(seed), size)
    return {"prompt": _IMAGE_MARK + "Describe the image.", "images": [_image_bytes(pixels)]}


def video_prompt(num_frames: int, size: int, seed: int) -> dict:
    """One video of `num_frames` frames ([T, H, W, 3] uint8, as decoded) with a short question."""
    frames = video_frames(np.random.default_rng(seed), num_frames, size)
    return {"prompt": _VIDEO_MARK + "Describe the video.", "videos": [frames]}


@dataclass(frozen=True)
class Workload:
    """An offline workload: `bench throughput`'s systems all run exactly these requests."""

    prompts: list[list[int]]  # token ids as the engine sees them (media placeholders expanded)
    output_lens: list[int]
    # random-mm / long-video: per request the chat-templated text with placeholders and its images (PIL)
    # and videos ([T, H, W, 3] uint8), or None for a text request (the engine gets its `prompts` ids);
    # transformers gets `prompts` plus pixels from its own image processor (videos: mmserve's, see
    # _hf_media_kwargs).
    mm_prompts: list[dict | None] | None = None
    # long-video: the driver step after which each request is added (None: all at once, as generate()).
    arrival_steps: list[int] | None = None
    video_tokens: int = 0  # placeholder tokens of one video (0: no videos)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def is_text(self, i: int) -> bool:
        return self.mm_prompts is None or self.mm_prompts[i] is None


def plain_ids(vocab_size: int) -> range:
    """Token ids well inside a vocabulary, away from the special tokens at either end."""
    return range(100, vocab_size - 200)


def random_prompts(rng: random.Random, n: int, length: int, ids: Sequence[int]) -> list[list[int]]:
    """`n` prompts of `length` token ids, each drawn from `ids` (a range draws as `randrange` would)."""
    return [[rng.choice(ids) for _ in range(length)] for _ in range(n)]


def _random_ids(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return random_prompts(rng, 1, n, plain_ids(vocab_size))[0]


def random_workload(vocab_size: int, c: ThroughputBenchConfig, seed: int) -> Workload:
    """`c.num_prompts` prompts of random ids, well inside the vocabulary (away from its special tokens)."""
    rng = random.Random(seed)
    prompts = [_random_ids(rng, vocab_size, rng.randint(*c.input_len)) for _ in range(c.num_prompts)]
    return Workload(prompts, [rng.randint(*c.output_len) for _ in range(c.num_prompts)])


def _template(body: str) -> str:
    """`body` as the user's turn in the Qwen chat template."""
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    return f"{system}<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def _expand(model_dir: Path, prompts: list) -> tuple[list[list[int]], int]:
    """The engine's token ids of each prompt (placeholders expanded by mmserve's own processor; nothing
    runs, the KV pool is only big enough that the model's own context limit applies), and the
    placeholder tokens of the last video seen (0: none): for Qwen3-VL, whose video is one input per
    temporal group (timestamps between them), the sum over the request's video inputs."""
    from mmserve import LLM, SamplingParams

    processor = LLM(model_dir, num_kv_blocks=4096).processor
    ids, video_tokens = [], 0
    for i, p in enumerate(prompts):
        request = processor.process(p, SamplingParams(max_tokens=1), f"w{i}")[0]
        ids.append(request.prompt_token_ids)
        video_tokens = sum(m.placeholder.length for m in request.mm_inputs if m.modality == "video") or video_tokens
    return ids, video_tokens


def offline_workload(model_dir: Path, c: ThroughputBenchConfig, vocab_size: int) -> Workload:
    """`c.workload`'s requests as the engine sees them (`c` resolved). `random`: random ids; `prefix`: every
    prompt starts with the same `prefix_len` random ids (drawn with `seed`), then a random suffix (with
    `seed` + 1): prefix-cache hits."""
    if c.workload == "random-mm":
        return random_mm_workload(model_dir, c)
    if c.workload == "long-video":
        return long_video_workload(model_dir, vocab_size, c)
    prefix = _random_ids(random.Random(c.seed), vocab_size, c.prefix_len) if c.workload == "prefix" else []
    base = random_workload(vocab_size, c, c.seed + (c.workload == "prefix"))
    return Workload([prefix + p for p in base.prompts], base.output_lens)


def random_mm_workload(model_dir: Path, c: ThroughputBenchConfig) -> Workload:
    """Each prompt: `num_images` random images of `image_size`^2 pixels, then (num_frames > 0) one video
    of `num_frames` random `video_size`^2 frames, all distinct (no cache hits), and a random text."""
    from PIL import Image

    num_images, num_frames = c.num_images, c.num_frames or 0
    _check_media(num_images, num_frames)
    rng, np_rng = random.Random(c.seed), np.random.default_rng(c.seed)
    words = "red blue green circle square shape image count colour left right top bottom".split()
    mm_prompts: list[dict | None] = []
    for _ in range(c.num_prompts):
        images = [Image.fromarray(random_pixels(np_rng, c.image_size)) for _ in range(num_images)]
        videos = [video_frames(np_rng, num_frames, c.video_size or 112)] if num_frames else []
        text = " ".join(rng.choice(words) for _ in range(rng.randint(*c.input_len)))
        marks = _IMAGE_MARK * num_images + _VIDEO_MARK * len(videos)
        mm_prompts.append({"prompt": _template(marks + text), "images": images, "videos": videos})
    ids, video_tokens = _expand(model_dir, mm_prompts)
    out_lens = [rng.randint(*c.output_len) for _ in range(c.num_prompts)]
    return Workload(ids, out_lens, mm_prompts, video_tokens=video_tokens)


def long_video_workload(model_dir: Path, vocab_size: int, c: ThroughputBenchConfig) -> Workload:
    """`num_prompts` random text requests added at once, then `num_videos` video requests (one random
    video and a short question each) added one every `video_interval_steps` driver steps, the first 4
    steps after the text prompts could have prefilled at the token budget. The schedule counts steps, not
    seconds, so every mmserve system sees the same arrivals.

    Text outputs are the random lengths plus enough steps to outlast every video's chunked prefill
    (budget left beside the decodes, or the encoder budget, whichever is smaller), so the videos
    always arrive into a steady set of decodes."""
    num_prompts, num_videos, num_frames = c.num_prompts, c.num_videos, c.num_frames or 0
    budget = c.max_num_batched_tokens or 0
    if num_videos < 1 or num_frames < 1 or c.video_interval_steps < 1:
        raise ValueError("long-video needs --num-videos, --num-frames and --video-interval-steps >= 1")
    text = random_workload(vocab_size, c, c.seed)
    np_rng = np.random.default_rng(c.seed + 1)
    videos = [{"prompt": _template(_VIDEO_MARK + f"What happens in clip {j}?"),
               "videos": [video_frames(np_rng, num_frames, c.video_size or 224)]}
              for j in range(num_videos)]  # fmt: skip
    video_ids, video_tokens = _expand(model_dir, videos)
    first = -(-text.num_prompt_tokens // budget) + 4  # 4 steps after the texts could have prefilled
    arrivals = [first + j * c.video_interval_steps for j in range(num_videos)]
    per_step = max(1, min(budget - num_prompts, c.max_num_encoder_tokens or budget))
    prefill_steps = sum(-(-len(p) // per_step) for p in video_ids)
    cover = arrivals[-1] + prefill_steps + VIDEO_OUTPUT_LEN
    out_lens = [n + cover for n in text.output_lens] + [VIDEO_OUTPUT_LEN] * num_videos
    return Workload(text.prompts + video_ids, out_lens, mm_prompts=[None] * num_prompts + videos,
                    arrival_steps=[0] * num_prompts + arrivals, video_tokens=video_tokens)  # fmt: skip
