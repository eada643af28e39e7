"""Greedy parity of the sampling fields (repetition/presence/frequency penalties, logit_bias,
bad_words_token_ids) with transformers' generate() and its logits processors, on a tiny qwen2
checkpoint; each field must change the output; a mixed batch equals its rows alone; validation."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidRequestError

N = 12


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Callable[[str], Path]):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("qwen2")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rng = random.Random(7)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17)]
    return LLM(model_dir), model, prompts


class OpenAIPenalties:
    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf(model, prompt: list[int], processors: list, eos_token_id: int | None = None) -> list[int]:
    """transformers' greedy continuation; with `eos_token_id` None it runs the full N tokens."""
    from transformers import LogitsProcessorList

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=N,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
            logits_processor=LogitsProcessorList(processors),
        )
    return out[0, len(prompt) :].tolist()


def mm(llm: LLM, prompt: list[int], **fields) -> list[int]:
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, **fields)
    return llm.generate([prompt], params)[0].token_ids


def plain(llm: LLM, prompt: list[int]) -> list[int]:
    return mm(llm, prompt)


def test_repetition_penalty(setup) -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    llm, model, prompts = setup
    changed = False
    for p in prompts:
        got = mm(llm, p, repetition_penalty=1.8)
        assert got == hf(model, p, [RepetitionPenaltyLogitsProcessor(1.8)])
        changed |= got != plain(llm, p)
    assert changed


@pytest.mark.parametrize("presence,frequency", [(0.0, 1.5), (1.5, 0.0), (1.0, 1.0)])
def test_presence_frequency(setup, presence: float, frequency: float) -> None:
    llm, model, prompts = setup
    changed = False
    for p in prompts:
        got = mm(llm, p, presence_penalty=presence, frequency_penalty=frequency)
        assert got == hf(model, p, [OpenAIPenalties(len(p), presence, frequency)])
        changed |= got != plain(llm, p)
    assert changed


def test_logit_bias(setup) -> None:
    from transformers import SequenceBiasLogitsProcessor

    llm, model, prompts = setup
    for p in prompts:
        base = plain(llm, p)
        bias = {base[0]: -100.0, (base[0] + 1) % model.config.vocab_size: 5.0}
        got = mm(llm, p, logit_bias=bias)
        assert got == hf(model, p, [SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})])
        assert got != base


def test_bad_words_single_token(setup) -> None:
    from transformers import NoBadWordsLogitsProcessor

    llm, model, prompts = setup
    for p in prompts:
        base = plain(llm, p)
        words = [[base[0]], [base[1]]]
        got = mm(llm, p, bad_words_token_ids=words)
        assert got == hf(model, p, [NoBadWordsLogitsProcessor(words, eos_token_id=None)])
        assert got != base
        assert base[0] not in got and base[1] not in got


def test_mixed_batch_rows_equal_alone(setup) -> None:
    llm, _, prompts = setup
    base = plain(llm, prompts[0])
    rows = [
        dict(repetition_penalty=1.8),
        dict(frequency_penalty=1.5, presence_penalty=0.5),
        dict(logit_bias={base[0]: -100.0}),
        dict(bad_words_token_ids=[[base[1]]]),
        dict(),
    ]
    batch_prompts = [prompts[i % 2] for i in range(len(rows))]
    params = [SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, **r) for r in rows]
    outs = llm.generate(batch_prompts, params)
    for prompt, row, out in zip(batch_prompts, rows, outs, strict=True):
        assert out.token_ids == mm(llm, prompt, **row)


@pytest.mark.parametrize(
    "fields,param",
    [
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=2.5), "repetition_penalty"),
        (dict(logit_bias={1: 101.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
        (dict(bad_words_token_ids=[[-3]]), "bad_words_token_ids"),
    ],
)
def test_validation(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**fields)
    assert err.value.param == param


def test_min_tokens_with_eos_biased(setup) -> None:
    from transformers import MinNewTokensLengthLogitsProcessor, SequenceBiasLogitsProcessor

    llm, model, prompts = setup
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    for p in prompts:
        params = SamplingParams(max_tokens=N, temperature=0.0, min_tokens=5, logit_bias={eos: 100.0})
        out = llm.generate([p], params)[0]
        processors = [SequenceBiasLogitsProcessor({(eos,): 100.0}), MinNewTokensLengthLogitsProcessor(len(p), 5, eos)]
        ref = hf(model, p, processors, eos_token_id=eos)
        assert ref[-1] == eos and len(ref) == 6
        assert [t for t in out.token_ids if t != eos] == ref[:-1]
        assert out.finish_reason == "stop"
