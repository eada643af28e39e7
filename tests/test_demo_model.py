"""The committed demo model (assets/demo-model) through mmserve: it answers easy-vqa test questions and
questions about held-out moving-shape clips correctly, and its answers are token-for-token those of
transformers' `generate()` on the same inputs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from mmserve import LLM
from mmserve.demo import DEMO_MODEL_DIR, resolve_model
from mmserve.demo.data import (
    COLORS,
    SHAPES,
    easy_vqa_image_paths,
    easy_vqa_questions,
    make_clips,
    video_questions,
)
from mmserve.demo.evaluate import GREEDY, image_conversation, normalize, video_conversation
from mmserve.demo.train import HELD_OUT_CLIP_SEED
from mmserve.encoders.media import load_video
from mmserve.encoders.preprocess import load_preprocess_config, preprocess_video

pytestmark = pytest.mark.skipif(
    not (DEMO_MODEL_DIR / "config.json").is_file(), reason="the demo model is not committed in this checkout"
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("demo")


@pytest.fixture(scope="module")
def image_cases() -> list[tuple[list[dict], str]]:
    """40 easy-vqa test questions, drawn with a fixed seed: every kind of question and answer appears."""
    questions = random.Random(7).sample(easy_vqa_questions("test"), 40)
    paths = easy_vqa_image_paths("test")
    return [(image_conversation(Path(paths[q.media_id]).read_bytes(), q.text), q.answer) for q in questions]


@pytest.fixture(scope="module")
def naming_cases() -> list[tuple[list[dict], str]]:
    """40 easy-vqa test questions whose answer names the shape or the colour shown (seeded)."""
    pool = [q for q in easy_vqa_questions("test") if q.answer not in ("yes", "no")]
    paths = easy_vqa_image_paths("test")
    return [
        (image_conversation(Path(paths[q.media_id]).read_bytes(), q.text), q.answer)
        for q in random.Random(8).sample(pool, 40)
    ]


@pytest.fixture(scope="module")
def video_cases() -> list[tuple[list[dict], str]]:
    rng = random.Random(3)
    return [
        (video_conversation(clip.mp4, text), answer)
        for clip in make_clips(6, HELD_OUT_CLIP_SEED)
        for text, answer in video_questions(clip, rng)
    ]


def test_demo_name_resolves_to_the_committed_checkpoint() -> None:
    assert resolve_model("demo") == DEMO_MODEL_DIR
    assert resolve_model("some/dir") == Path("some/dir")
    size = sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir())
    assert size <= 25 * 2**20, f"the demo model takes {size} bytes; the budget is 25 MiB"


def _num_right(llm: LLM, cases: list[tuple[list[dict], str]]) -> int:
    outputs = llm.chat([c for c, _ in cases], GREEDY)
    assert all(o.finish_reason == "stop" for o in outputs)  # one word, then <|im_end|>
    answers = [normalize(o.text) for o in outputs]
    return sum(a == e for a, e in zip(answers, [e for _, e in cases], strict=True))


def test_names_the_shape_and_colour_in_easy_vqa_test_images(
    llm: LLM, naming_cases: list[tuple[list[dict], str]]
) -> None:
    # eval-demo: shape 87.8%, colour 99.5% over the whole test split.
    assert _num_right(llm, naming_cases) >= 36
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def test_answers_easy_vqa_test_questions(llm: LLM, image_cases: list[tuple[list[dict], str]]) -> None:
    # eval-demo: 90.0% over all 9,673 test questions. Yes/no questions about colour are answered from the
    # picture, those about shape mostly from their wording (docs/demo_model.md), so a fault in how the
    # image reaches the model shows in the naming test above more than here.
    assert _num_right(llm, image_cases) >= 32


def test_answers_questions_about_held_out_clips(llm: LLM, video_cases: list[tuple[list[dict], str]]) -> None:
    outputs = llm.chat([c for c, _ in video_cases], GREEDY)
    answers = [normalize(o.text) for o in outputs]
    expected = [a for _, a in video_cases]
    pairs = list(zip(answers, expected, strict=True))
    # eval-demo on 400 held-out clip questions: 68.8% (colour 100%, shape 84%, direction 50%, yes/no 41%;
    # the model's weak side, docs/demo_model.md). Chance over these four kinds is about 30%.
    assert sum(a == e for a, e in pairs) >= 0.5 * len(pairs), pairs
    naming = [(a, e) for a, e in pairs if e in (*SHAPES, *COLORS)]
    assert sum(a == e for a, e in naming) >= 0.75 * len(naming), naming


def _hf_generate(model: torch.nn.Module, llm: LLM, conversation: list[dict]) -> list[int]:
    """transformers' greedy answer on the prompt mmserve builds, with transformers' own image processor
    (videos: mmserve's frame-by-frame processing of the decoded clip, as transformers' needs torchvision)."""
    from transformers import AutoImageProcessor

    prompt = llm.processor.chat_prompt(conversation)
    request, _ = llm.processor.process(prompt, GREEDY, "ref")
    ids = torch.tensor([request.prompt_token_ids])
    cfg = model.config
    types = (ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long()
    kwargs: dict = {}
    if prompt["images"]:
        from io import BytesIO

        from PIL import Image

        image = Image.open(BytesIO(prompt["images"][0])).convert("RGB")
        px = AutoImageProcessor.from_pretrained(DEMO_MODEL_DIR)(images=[image], return_tensors="pt")
        kwargs.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
    if prompt["videos"]:
        frames = load_video(prompt["videos"][0]).frames
        processed = preprocess_video(frames, load_preprocess_config(DEMO_MODEL_DIR, "video"))
        kwargs.update(
            pixel_values_videos=processed.pixel_values, video_grid_thw=torch.tensor([processed.grid_thw])
        )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
            max_new_tokens=GREEDY.max_tokens, do_sample=False, **kwargs,
        )  # fmt: skip
    tokens = out[0, ids.shape[1] :].tolist()
    eos = set(llm.processor.eos_token_ids)
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))]


def test_answers_equal_transformers_generate(
    llm: LLM, image_cases: list[tuple[list[dict], str]], video_cases: list[tuple[list[dict], str]]
) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    cases = [c for c, _ in image_cases[:8]] + [c for c, _ in video_cases[:4]]
    outputs = llm.chat(cases, GREEDY)
    for conversation, out in zip(cases, outputs, strict=True):
        assert out.token_ids == _hf_generate(model, llm, conversation)
