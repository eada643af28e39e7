"""The offline benchmark's workloads: token ids as the engine sees them (media placeholders expanded by
mmserve's own processor), output lengths, media and arrival schedules. Shared by every system of
`mmserve bench throughput`, so all of them run exactly the same requests."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Workload:
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


def random_workload(
    vocab_size: int, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0
) -> Workload:
    rng = random.Random(seed)
    # Ids well inside the vocabulary, away from the special tokens at its end.
    prompts = [
        [rng.randrange(100, vocab_size - 200) for _ in range(rng.randint(*input_len))]
        for _ in range(num_prompts)
    ]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_prompts)])


def prefix_workload(
    vocab_size: int,
    num_prompts: int,
    prefix_len: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
) -> Workload:
    """Every prompt starts with the same `prefix_len` tokens, then a random suffix (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab_size - 200) for _ in range(prefix_len)]
    base = random_workload(vocab_size, num_prompts, input_len, output_len, seed + 1)
    return Workload([prefix + p for p in base.prompts], base.output_lens)


def _template(body: str) -> str:
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        f"{body}<|im_end|>\n<|im_start|>assistant\n"
    )


_IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
_VIDEO_MARK = "<|vision_start|><|video_pad|><|vision_end|>"
FIRST_VIDEO_STEP = 4  # long-video: steps after the text prefills before the first video arrives
VIDEO_OUTPUT_LEN = 8  # long-video: tokens each video request generates (a short answer)


def _random_frames(np_rng: np.random.Generator, num_frames: int, size: int) -> np.ndarray:
    return np_rng.integers(0, 255, (num_frames, size, size, 3), dtype=np.uint8)  # [T, H, W, 3]


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


def random_mm_workload(
    model_dir: Path,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    num_images: int = 1,
    image_size: int = 64,
    seed: int = 0,
    num_frames: int = 0,
    video_size: int = 112,
) -> Workload:
    """Each prompt: `num_images` random images of `image_size`^2 pixels, then (num_frames > 0) one video
    of `num_frames` random `video_size`^2 frames, all distinct (no cache hits), and a random text."""
    from PIL import Image

    if num_images < 0 or num_frames < 0 or num_images + num_frames == 0:
        raise ValueError("random-mm needs images (--num-images) or a video (--num-frames), none negative")
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    words = "red blue green circle square shape image count colour left right top bottom".split()
    mm_prompts: list[dict | None] = []
    for _ in range(num_prompts):
        images = [
            Image.fromarray(np_rng.integers(0, 255, (image_size, image_size, 3), dtype=np.uint8))
            for _ in range(num_images)
        ]
        videos = [_random_frames(np_rng, num_frames, video_size)] if num_frames else []
        text = " ".join(rng.choice(words) for _ in range(rng.randint(*input_len)))
        marks = _IMAGE_MARK * num_images + _VIDEO_MARK * len(videos)
        mm_prompts.append({"prompt": _template(marks + text), "images": images, "videos": videos})
    ids, video_tokens = _expand(model_dir, mm_prompts)
    out_lens = [rng.randint(*output_len) for _ in range(num_prompts)]
    return Workload(ids, out_lens, mm_prompts, video_tokens=video_tokens)


def long_video_workload(
    model_dir: Path,
    vocab_size: int,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    num_videos: int,
    num_frames: int,
    video_size: int,
    interval_steps: int,
    max_num_batched_tokens: int,
    max_num_encoder_tokens: int,
    seed: int = 0,
) -> Workload:
    """`num_prompts` random text requests added at once, then `num_videos` video requests (one random
    video and a short question each) added one every `interval_steps` driver steps, the first
    FIRST_VIDEO_STEP steps after the text prompts could have prefilled at the token budget. The
    schedule counts steps, not seconds, so every mmserve system sees the same arrivals.

    Text outputs are the random lengths plus enough steps to outlast every video's chunked prefill
    (budget left beside the decodes, or the encoder budget, whichever is smaller), so the videos
    always arrive into a steady set of decodes."""
    if num_videos < 1 or num_frames < 1 or interval_steps < 1:
        raise ValueError("long-video needs --num-videos, --num-frames and --video-interval-steps >= 1")
    text = random_workload(vocab_size, num_prompts, input_len, output_len, seed)
    np_rng = np.random.default_rng(seed + 1)
    videos = [
        {
            "prompt": _template(_VIDEO_MARK + f"What happens in clip {j}?"),
            "videos": [_random_frames(np_rng, num_frames, video_size)],
        }
        for j in range(num_videos)
    ]
    video_ids, video_tokens = _expand(model_dir, videos)
    first = -(-text.num_prompt_tokens // max_num_batched_tokens) + FIRST_VIDEO_STEP
    arrivals = [first + j * interval_steps for j in range(num_videos)]
    per_step = max(1, min(max_num_batched_tokens - num_prompts, max_num_encoder_tokens))
    prefill_steps = sum(-(-len(p) // per_step) for p in video_ids)
    cover = arrivals[-1] + prefill_steps + VIDEO_OUTPUT_LEN
    return Workload(
        prompts=text.prompts + video_ids,
        output_lens=[n + cover for n in text.output_lens] + [VIDEO_OUTPUT_LEN] * num_videos,
        mm_prompts=[None] * num_prompts + videos,
        arrival_steps=[0] * num_prompts + arrivals,
        video_tokens=video_tokens,
    )
