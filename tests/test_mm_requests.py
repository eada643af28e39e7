"""Media requests through the offline API: chat content parts with real media from assets/, the
prompt-dict form, stats, and bad input — each bad item gets a clear InvalidRequestError, costs
nothing else, and the engine serves the next request with every block and cache entry free."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidRequestError
from tests.test_media import png_header_only

ASSETS = Path(__file__).resolve().parent.parent / "assets"
PHOTO, CLIP = ASSETS / "sample.jpg", ASSETS / "sample_clip.mp4"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is this?"


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Callable[[str], Path]) -> LLM:
    return LLM(tiny_model_dir("qwen2_vl"), max_num_batched_tokens=64)


def assert_clean(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0
    assert llm.stats().num_referenced_encoder_tokens == 0


def test_chat_with_real_photo_and_clip(llm: LLM) -> None:
    data_url = "data:image/jpeg;base64," + __import__("base64").b64encode(PHOTO.read_bytes()).decode()
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(PHOTO)}},
        {"type": "text", "text": "and this clip"},
        {"type": "video_url", "video_url": {"url": str(CLIP)}},
        {"type": "image_url", "image_url": {"url": data_url}},
    ]}]  # fmt: skip
    (out,) = llm.chat(messages, GREEDY)
    assert len(out.token_ids) == 4
    # The same photo twice (path and data URL) has one mm_hash, so it is encoded once.
    request, _ = llm.processor.process(llm.processor.chat_prompt(messages), GREEDY, "x")
    kinds = [(mm.modality, mm.num_groups) for mm in request.mm_inputs]
    assert kinds[0] == ("image", 1) and kinds[1][0] == "video" and kinds[1][1] == 3  # 6 frames at 2 fps
    assert request.mm_inputs[0].mm_hash == request.mm_inputs[2].mm_hash
    photo, video = request.mm_inputs[0].placeholder.length, request.mm_inputs[1].placeholder.length
    assert llm.stats().num_encoder_tokens_computed == photo + video  # the photo was encoded once
    assert_clean(llm)


def test_prompt_dict_with_each_media_form(llm: LLM) -> None:
    from PIL import Image

    forms = [PHOTO, str(PHOTO), PHOTO.read_bytes(), Image.open(PHOTO)]
    outs = llm.generate([{"prompt": IMAGE_PROMPT, "images": [f]} for f in forms], GREEDY)
    assert len({tuple(o.token_ids) for o in outs}) == 1
    video = np.zeros((4, 56, 56, 3), np.uint8)
    for source in (CLIP, CLIP.read_bytes(), video):
        (out,) = llm.generate(
            [{"prompt": "<|vision_start|><|video_pad|><|vision_end|>?", "videos": [source]}], GREEDY
        )
        assert out.finish_reason == "length"
    assert llm.stats().num_encoder_tokens_computed > 0
    assert_clean(llm)


BAD_INPUTS = {
    "corrupt image bytes": ({"images": [b"\xff\xd8\xff\xe0 definitely not a jpeg"]}, "image 0"),
    "truncated jpeg": ({"images": [PHOTO.read_bytes()[:2000]]}, "image 0"),
    "unknown format": ({"images": [b"hello, world"]}, "image 0"),
    "30000x30000 png": ({"images": [png_header_only(30000, 30000)]}, "max_image_pixels"),
    "zero-frame video": ({"videos": [np.zeros((0, 8, 8, 3), np.uint8)]}, "video 0"),
    "too many frames": ({"videos": [np.zeros((800, 8, 8, 3), np.uint8)]}, "max_video_frames"),
    "corrupt video bytes": ({"videos": [b"\x00\x00\x00\x18ftypmp42 garbage"]}, "video 0"),
    "too many items": ({"images": [PHOTO] * 33}, "max_items_per_prompt"),
    "more images than placeholders": ({"images": [PHOTO, PHOTO]}, "placeholders"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_media_is_rejected_and_costs_nothing_else(llm: LLM, name: str) -> None:
    media, expected = BAD_INPUTS[name]
    prompt = IMAGE_PROMPT if "images" in media else "<|vision_start|><|video_pad|><|vision_end|>?"
    if name == "too many items":
        prompt = "<|vision_start|><|image_pad|><|vision_end|>" * 33
    good = {"prompt": IMAGE_PROMPT, "images": [PHOTO]}
    with pytest.raises(InvalidRequestError, match=expected) as info:
        llm.generate([good, {"prompt": prompt, **media}], GREEDY)
    assert "Traceback" not in str(info.value)
    assert_clean(llm)
    assert llm.generate([good], GREEDY)[0].finish_reason == "length"
    assert_clean(llm)


def test_media_for_a_text_model_is_refused(tiny_model_dir: Callable[[str], Path]) -> None:
    text_llm = LLM(tiny_model_dir("qwen2"))
    with pytest.raises(InvalidRequestError, match="no images"):
        text_llm.generate([{"prompt": "hi", "images": [PHOTO]}], GREEDY)
