"""Greedy parity with transformers' generate() on tiny checkpoints of each architecture: identical
tokens and chosen-token logprobs within 1e-3, under default settings, a 7-token budget, a pool of a
dozen blocks (preemption), and prefix caching over shared prefixes. All blocks are free afterwards."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mmserve import LLM, SamplingParams
from tests.conftest import ARCHS

NUM_NEW_TOKENS = 10
PROMPT_LENGTHS = (1, 2, 9, 31, 64, 133, 257, 400)


def random_prompts(vocab_size: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def hf_reference(model_dir: Path, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and their logprobs, one prompt at a time (no padding)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [
            torch.log_softmax(step[0].float(), -1)[t].item()
            for step, t in zip(out.logits, tokens, strict=True)
        ]
        results.append((tokens, logprobs))
    return results


@pytest.fixture(scope="module", params=ARCHS)
def case(
    request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]
) -> tuple[Path, list, list, list]:
    model_dir = tiny_model_dir(request.param)
    vocab_size = _vocab_size(model_dir)
    prompts = random_prompts(vocab_size, PROMPT_LENGTHS, seed=1)
    # Shared-prefix prompts: a 100-token system part, then different questions.
    prefix = random_prompts(vocab_size, (100,), seed=2)[0]
    shared = [prefix + tail for tail in random_prompts(vocab_size, (1, 5, 20, 37), seed=3)]
    # Same as the last one but for one token at the end of a block: it must not share that block.
    variant = list(shared[-1])
    variant[47] = (variant[47] + 1) % vocab_size
    shared.append(variant)
    return model_dir, prompts, shared, hf_reference(model_dir, prompts + shared)


def _vocab_size(model_dir: Path) -> int:
    from mmserve.models.config import DecoderConfig

    return DecoderConfig.from_pretrained(model_dir)[0].vocab_size


GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


def check(llm: LLM, prompts: list[list[int]], expected: list[tuple[list[int], list[float]]]) -> None:
    outputs = llm.generate(prompts, GREEDY)
    for prompt, out, (tokens, logprobs) in zip(prompts, outputs, expected, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        assert got == pytest.approx(logprobs, abs=1e-3)
        assert out.finish_reason == "length"
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0


def test_default_settings(case: tuple) -> None:
    model_dir, prompts, _, expected = case
    check(LLM(model_dir), prompts, expected[: len(prompts)])


def test_seven_token_budget(case: tuple) -> None:
    model_dir, prompts, _, expected = case
    check(LLM(model_dir, max_num_batched_tokens=7), prompts, expected[: len(prompts)])


def test_dozen_block_pool_preempts(case: tuple) -> None:
    model_dir, prompts, _, expected = case
    # 12 blocks of 64 tokens: the longest request fits alone, all of them together do not.
    llm = LLM(model_dir, num_kv_blocks=12, block_size=64, max_num_batched_tokens=64, max_step_ms=0)  # token budgets only: preemption must not depend on the machine's load
    check(llm, prompts, expected[: len(prompts)])
    assert llm.stats().num_preemptions > 0


def test_small_blocks_chunked_and_preempting(case: tuple) -> None:
    model_dir, prompts, _, expected = case
    short = [i for i, p in enumerate(prompts) if len(p) <= 64]
    llm = LLM(model_dir, num_kv_blocks=12, block_size=8, max_num_batched_tokens=13)
    check(llm, [prompts[i] for i in short], [expected[i] for i in short])
    assert llm.stats().num_preemptions > 0


def test_prefix_caching_hits_and_keeps_output(case: tuple) -> None:
    model_dir, prompts, shared, expected = case
    llm = LLM(model_dir, block_size=16)
    check(llm, shared, expected[len(prompts) :])
    first = llm.stats().prefix_cache_hits
    assert first > 0  # later prompts of the batch reuse the first one's prefix blocks
    check(llm, shared, expected[len(prompts) :])  # again: everything but the last partial block hits
    assert llm.stats().prefix_cache_hits - first >= sum((len(p) - 1) // 16 * 16 for p in shared)


def test_prefix_caching_off_gives_same_output(case: tuple) -> None:
    model_dir, prompts, shared, expected = case
    llm = LLM(model_dir, enable_prefix_caching=False, max_num_batched_tokens=50)
    check(llm, shared, expected[len(prompts) :])
    assert llm.stats().prefix_cache_hits == 0


def test_chunks_through_padded_causal_attention_keep_output(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fp32 chunk after no more cached tokens than its own takes the zero-padded causal flash call (the rule
    is for chunks of 1,024+ rows; lowered here to reach the tiny prompts), and the outputs stay transformers'."""
    from mmserve.kernels import reference

    model_dir, prompts, _, expected = case
    monkeypatch.setattr(reference, "_PAD_MIN_ROWS", 1)
    calls = []
    padded = reference._padded_causal_sdpa
    monkeypatch.setattr(reference, "_padded_causal_sdpa", lambda *args: calls.append(1) or padded(*args))
    check(LLM(model_dir, max_num_batched_tokens=64), prompts, expected[: len(prompts)])
    assert calls  # the second 64-token chunk of each prompt over 64 tokens
