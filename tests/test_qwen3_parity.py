"""Greedy parity with transformers' generate() for the Qwen3 family on tiny generated checkpoints: Qwen3 and
Qwen3-MoE text, Qwen3-VL and Qwen3-VL-MoE with images and videos (timestamps included). Identical tokens and
chosen-token logprobs within 1e-3, under default settings, a 7-token budget (smaller than one image),
preemption, prefix caching (with a same-text, different-image false-hit probe) and an encoder budget of one
temporal group. Every KV block and encoder-cache entry is free afterwards.

transformers' reference runs once per architecture (module fixtures); each scenario reuses it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.models.config import DecoderConfig
from tests.test_mm_parity import GREEDY, hf_references, rng_image, rng_video
from tests.test_mm_parity import user as qwen2_user
from tests.test_parity import GREEDY as TEXT_GREEDY
from tests.test_parity import hf_reference, random_prompts


def check(
    llm: LLM, prompts: list, expected: list[tuple[list[int], list[float]]], params: SamplingParams = GREEDY
) -> None:
    outputs = llm.generate(prompts, params)
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == tokens, f"prompt {i} diverged"
        got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        assert got == pytest.approx(logprobs, abs=1e-3), f"prompt {i}"
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_referenced_encoder_tokens == 0
    assert stats.num_running == stats.num_waiting == 0


# ------------------------------------------------------------------------------------------------ text


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def text_case(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]) -> tuple[Path, list, list]:
    model_dir = tiny_model_dir(request.param)
    vocab_size = DecoderConfig.from_pretrained(model_dir)[0].vocab_size
    prompts = random_prompts(vocab_size, (1, 9, 64, 133), seed=1)
    prefix = random_prompts(vocab_size, (70,), seed=2)[0]
    prompts += [prefix + tail for tail in random_prompts(vocab_size, (3, 30), seed=3)]
    return model_dir, prompts, hf_reference(model_dir, prompts)


def test_text_default_settings_and_prefix_caching(text_case: tuple) -> None:
    model_dir, prompts, expected = text_case
    llm = LLM(model_dir, block_size=16)
    check(llm, prompts, expected, TEXT_GREEDY)
    hits = llm.stats().prefix_cache_hits
    check(llm, prompts[-2:], expected[-2:], TEXT_GREEDY)  # the shared-prefix pair again: whole blocks hit
    assert llm.stats().prefix_cache_hits - hits >= 64


def test_text_seven_token_budget(text_case: tuple) -> None:
    model_dir, prompts, expected = text_case
    check(LLM(model_dir, max_num_batched_tokens=7), prompts, expected, TEXT_GREEDY)


def test_text_preemption(text_case: tuple) -> None:
    model_dir, prompts, expected = text_case
    llm = LLM(model_dir, num_kv_blocks=12, block_size=32, max_num_batched_tokens=64, max_step_ms=0)  # token budgets only
    check(llm, prompts, expected, TEXT_GREEDY)
    assert llm.stats().num_preemptions > 0


# ------------------------------------------------------------------------------------------ multimodal


def user(*parts: str) -> str:
    """A prompt in the tiny Qwen3 template's format (no default system turn)."""
    return qwen2_user(*parts, system=None)


IMG_ODD = rng_image(2, 150, 100)  # resized to 96x160: 15 tokens
IMG_BIG = rng_image(3, 320, 240)  # shrunk to the tiny pixel bound
IMAGE_CASES: dict[str, dict] = {
    "text": {"prompt": user("Say something about shapes.")},
    "image_odd": {"prompt": user("Describe", "image"), "images": [IMG_ODD]},
    "two_images": {"prompt": user("image", "and", "image", "compare"), "images": [IMG_BIG, IMG_ODD]},
}
VIDEO_CASES: dict[str, dict] = {
    "video_even": {"prompt": user("video", "What happens?"), "videos": [rng_video(4, 6, 64, 64)]},
    "video_odd": {"prompt": user("video", "Describe the clip."), "videos": [rng_video(5, 5, 96, 64)]},
    "image_and_video": {
        "prompt": user("image", "then", "video", "?"),
        "images": [IMG_ODD],
        "videos": [rng_video(6, 4, 64, 64)],
    },
}
MM_CASES: dict[str, dict] = {**IMAGE_CASES, **VIDEO_CASES}


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe"])
def mm_case(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]) -> tuple[Path, dict]:
    model_dir = tiny_model_dir(request.param)
    return model_dir, hf_references(model_dir, MM_CASES)


def check_mm(llm: LLM, names: list[str], expected: dict) -> None:
    check(llm, [MM_CASES[n] for n in names], [expected[n] for n in names])


def test_mm_each_case_alone_and_all_mixed(mm_case: tuple) -> None:
    model_dir, expected = mm_case
    llm = LLM(model_dir)
    for name in MM_CASES:
        check_mm(llm, [name], expected)
    check_mm(llm, list(MM_CASES), expected)


def test_mm_token_budget_smaller_than_one_image(mm_case: tuple) -> None:
    model_dir, expected = mm_case
    check_mm(LLM(model_dir, max_num_batched_tokens=7), list(MM_CASES), expected)


@pytest.mark.parametrize("policy", ["slo", "priority"])
def test_mm_other_scheduling_policies(mm_case: tuple, policy: str) -> None:
    model_dir, expected = mm_case
    check_mm(LLM(model_dir, scheduler_policy=policy, max_num_batched_tokens=32), list(MM_CASES), expected)


def test_mm_preemption(mm_case: tuple) -> None:
    model_dir, expected = mm_case
    llm = LLM(model_dir, num_kv_blocks=8, block_size=16, max_num_batched_tokens=32)
    check_mm(llm, ["image_odd", "video_even", "two_images", "image_and_video"], expected)
    assert llm.stats().num_preemptions > 0


def test_mm_encoder_budget_of_one_temporal_group(mm_case: tuple) -> None:
    model_dir, expected = mm_case
    llm = LLM(model_dir, max_num_encoder_tokens=4)  # a 64x64 frame group is 4 tokens
    check_mm(llm, ["video_even", "text"], expected)
    encoded = [s.num_encoder_tokens for s in llm.step_records if s.num_encoder_tokens]
    assert len(encoded) >= 3 and max(encoded) <= 4


def test_mm_prefix_cache_hits_repeat_image_and_never_a_different_one(mm_case: tuple) -> None:
    model_dir, expected = mm_case
    llm = LLM(model_dir, block_size=8)
    check_mm(llm, ["image_odd"], expected)
    hits = llm.stats().prefix_cache_hits
    check_mm(llm, ["image_odd"], expected)
    assert llm.stats().prefix_cache_hits > hits
    other = {"prompt": MM_CASES["image_odd"]["prompt"], "images": [rng_image(9, 150, 100)]}
    (a,) = llm.generate([other], GREEDY)
    (b,) = LLM(model_dir, enable_prefix_caching=False).generate([other], GREEDY)
    assert a.token_ids == b.token_ids
    got = [lp[t] for lp, t in zip(a.logprobs, a.token_ids, strict=True)]
    assert got == pytest.approx([lp[t] for lp, t in zip(b.logprobs, b.token_ids, strict=True)], abs=1e-5)
