"""Image and video parity with transformers on tiny Qwen2-VL and Qwen2.5-VL checkpoints: identical
greedy tokens and chosen-token logprobs within 1e-3, for single and several images, videos with
even and odd frame counts, image + video, and mixed batches with text, under default settings, a
token budget smaller than one image, a small encoder budget over a long video, preemption, and
prefix caching. Afterwards every KV block and encoder-cache entry is free."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve import LLM, SamplingParams
from mmserve.encoders.preprocess import load_preprocess_config, preprocess_video

NUM_NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
VIDEO_FPS = 2.0  # arrays are taken at the default sampling rate


def rng_image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def rng_video(seed: int, frames: int, width: int = 56, height: int = 56) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (frames, height, width, 3), dtype=np.uint8)


IMG_SMALL = rng_image(1, 56, 84)  # already a multiple of 28: no resize
IMG_RESIZED = rng_image(2, 150, 100)  # needs a resize
IMG_BIG = rng_image(3, 320, 240)  # shrunk to the tiny max_pixels
VID_EVEN = rng_video(4, 6)
VID_ODD = rng_video(5, 5)
VID_LONG = rng_video(6, 16, 84, 56)  # 8 temporal groups


def user(*parts: str, system: str | None = "You are a helpful assistant.") -> str:
    """A templated prompt in the tiny models' format (Qwen2-VL's default system turn; `system=None` for
    Qwen3's template, which has none); parts are text or 'image' / 'video' markers."""
    body = "".join(
        "<|vision_start|><|image_pad|><|vision_end|>"
        if p == "image"
        else "<|vision_start|><|video_pad|><|vision_end|>"
        if p == "video"
        else p
        for p in parts
    )
    turn = "" if system is None else f"<|im_start|>system\n{system}<|im_end|>\n"
    return f"{turn}<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


CASES: dict[str, dict] = {
    "text": {"prompt": user("Say something about shapes.")},
    "image_no_resize": {"prompt": user("image", "What is this?"), "images": [IMG_SMALL]},
    "image_resized": {"prompt": user("Describe", "image"), "images": [IMG_RESIZED]},
    "two_images": {"prompt": user("image", "and", "image", "compare"), "images": [IMG_BIG, IMG_RESIZED]},
    "video_even": {"prompt": user("video", "What happens?"), "videos": [VID_EVEN]},
    "video_odd": {"prompt": user("video", "Describe the clip."), "videos": [VID_ODD]},
    "image_and_video": {
        "prompt": user("image", "then", "video", "?"),
        "images": [IMG_SMALL],
        "videos": [VID_ODD],
    },
    "long_video": {"prompt": user("video", "Summarise."), "videos": [VID_LONG]},
}


def hf_reference(
    model: torch.nn.Module, model_dir: Path, llm: LLM, case: dict
) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens on the same expanded prompt, with pixels from its own image
    processor (videos: mmserve's frame-by-frame processing, as transformers' needs torchvision)."""
    from transformers import AutoImageProcessor

    request, _ = llm.processor.process(case, GREEDY, "ref")
    ids = torch.tensor([request.prompt_token_ids])
    cfg = model.config
    types = (ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long()
    kwargs: dict = {}
    if case.get("images"):
        px = AutoImageProcessor.from_pretrained(model_dir)(images=case["images"], return_tensors="pt")
        kwargs.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
    if case.get("videos"):
        vcfg = load_preprocess_config(model_dir, "video")
        processed = [preprocess_video(v, vcfg) for v in case["videos"]]
        kwargs.update(
            pixel_values_videos=torch.cat([p.pixel_values for p in processed]),
            video_grid_thw=torch.tensor([p.grid_thw for p in processed]),
        )
        if cfg.model_type == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = torch.tensor(
                [vcfg.temporal_patch_size / VIDEO_FPS] * len(processed)
            )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
            max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True, **kwargs,
        )  # fmt: skip
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def hf_references(model_dir: Path, cases: dict[str, dict]) -> dict[str, tuple[list[int], list[float]]]:
    """`hf_reference` of each case, with one transformers model and one mmserve processor."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(model_dir)
    return {name: hf_reference(model, model_dir, llm, case) for name, case in cases.items()}


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def setup(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]) -> tuple[Path, dict]:
    model_dir = tiny_model_dir(request.param)
    return model_dir, hf_references(model_dir, CASES)


def check(llm: LLM, names: list[str], expected: dict) -> None:
    outputs = llm.generate([CASES[n] for n in names], GREEDY)
    for name, out in zip(names, outputs, strict=True):
        tokens, logprobs = expected[name]
        assert out.token_ids == tokens, f"{name} diverged"
        got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        assert got == pytest.approx(logprobs, abs=1e-3), name
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert llm.stats().num_referenced_encoder_tokens == 0


def test_each_case_alone_and_all_mixed(setup: tuple[Path, dict]) -> None:
    model_dir, expected = setup
    llm = LLM(model_dir)
    for name in CASES:
        check(llm, [name], expected)
    check(llm, list(CASES), expected)  # one mixed batch: text, images, videos


def test_token_budget_smaller_than_one_image(setup: tuple[Path, dict]) -> None:
    model_dir, expected = setup
    llm = LLM(model_dir, max_num_batched_tokens=7)
    check(llm, list(CASES), expected)


def test_small_encoder_budget_spreads_a_long_video_over_steps(setup: tuple[Path, dict]) -> None:
    model_dir, expected = setup
    llm = LLM(model_dir, max_num_encoder_tokens=6)  # one temporal group (6 tokens) per step
    check(llm, ["long_video", "text"], expected)
    encoded = [s.num_encoder_tokens for s in llm.step_records if s.num_encoder_tokens]
    assert len(encoded) >= 8 and max(encoded) <= 6  # the step records say what each step encoded


def test_preemption(setup: tuple[Path, dict]) -> None:
    model_dir, expected = setup
    llm = LLM(model_dir, num_kv_blocks=10, block_size=16, max_num_batched_tokens=32)
    names = ["image_resized", "video_even", "two_images", "image_and_video"]
    check(llm, names, expected)
    assert llm.stats().num_preemptions > 0


def test_prefix_cache_hits_repeat_image_and_never_a_different_one(setup: tuple[Path, dict]) -> None:
    model_dir, expected = setup
    llm = LLM(model_dir, block_size=8)
    check(llm, ["image_resized"], expected)
    hits = llm.stats().prefix_cache_hits
    check(llm, ["image_resized"], expected)
    assert llm.stats().prefix_cache_hits > hits  # the repeat reuses KV over the image
    # Same text, same placeholder count, different pixels: must not reuse the image's blocks.
    other = {"prompt": CASES["image_resized"]["prompt"], "images": [rng_image(9, 150, 100)]}
    (a,) = llm.generate([other], GREEDY)
    (b,) = LLM(model_dir, enable_prefix_caching=False).generate([other], GREEDY)
    assert a.token_ids == b.token_ids
    got = [lp[t] for lp, t in zip(a.logprobs, a.token_ids, strict=True)]
    assert got == pytest.approx([lp[t] for lp, t in zip(b.logprobs, b.token_ids, strict=True)], abs=1e-5)
