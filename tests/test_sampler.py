"""Tests of `Sampler` and `SamplingMetadata`: greedy, logprobs, top-k, top-p, temperature, seeds."""

from __future__ import annotations

import pytest
import torch

from mmserve.engine import sampler as sampler_module
from mmserve.engine.sampler import Sampler, SamplingMetadata, SamplingMetadataCache, TokenEntries
from mmserve.request import SamplingParams

CPU = torch.device("cpu")


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int] | None = None
) -> sampler_module.SamplerOutput:
    indices = output_indices if output_indices is not None else [0] * len(params)
    return Sampler()(logits, SamplingMetadata.from_params(params, indices, CPU))


def _repeat(logits_row: torch.Tensor, n: int) -> torch.Tensor:
    return logits_row.unsqueeze(0).expand(n, -1).contiguous()  # [n, vocab]


def test_metadata_from_params() -> None:
    params = [
        SamplingParams(temperature=0.0, seed=3),
        SamplingParams(temperature=0.7, top_k=5, seed=11, logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.9, logprobs=0),
    ]
    meta = SamplingMetadata.from_params(params, [0, 4, 9], CPU)
    assert meta.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0])
    assert meta.top_k is not None and meta.top_k[1].item() == 5 and meta.top_k[0].item() > 10**6
    assert meta.top_p is not None and meta.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9])
    assert set(meta.generators) == {1}  # a greedy row needs no noise, seeded or not
    assert not meta.all_greedy
    assert meta.max_num_logprobs == 2

    plain = SamplingMetadata.from_params(
        [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-7)], [0, 0], CPU
    )
    assert plain.top_k is None and plain.top_p is None and plain.max_num_logprobs is None
    assert plain.all_greedy  # a temperature too small to divide by is greedy
    assert plain.temperature.tolist() == [0.0, 0.0]


def _same_metadata(a: SamplingMetadata, b: SamplingMetadata) -> bool:
    def same(x: object, y: object) -> bool:
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, TokenEntries) and isinstance(y, TokenEntries):
            return same(x.rows, y.rows) and same(x.token_ids, y.token_ids) and same(x.values, y.values)
        if isinstance(x, dict) and isinstance(y, dict):  # generators: the same rows in the same state
            return x.keys() == y.keys() and all(torch.equal(x[k].get_state(), y[k].get_state()) for k in x)
        return x == y

    return all(same(getattr(a, f), getattr(b, f)) for f in SamplingMetadata.__dataclass_fields__)


def test_metadata_cache_reuses_a_build_only_while_it_cannot_change() -> None:
    """Each step's metadata equals a fresh `from_params`; it is the previous step's object only when the
    rows are the same params objects in the same order and none depends on the step."""
    eos = [2]
    static = [
        SamplingParams(temperature=0.0, logit_bias={5: 1.5}, logprobs=1),
        SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_tokens=2),  # unseeded: the global RNG
    ]
    stepwise = [
        SamplingParams(temperature=0.8, seed=7),
        SamplingParams(min_tokens=3),
        SamplingParams(bad_words_token_ids=((4, 5),)),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(frequency_penalty=0.5),
    ]
    cache = SamplingMetadataCache()

    def build(params: list[SamplingParams], indices: list[int], **kw: object) -> SamplingMetadata:
        history = [[4] * (n + 3) for n in indices]
        got = cache.build(params, indices, CPU, token_ids=history, eos_token_ids=eos, vocab_size=16, **kw)
        fresh = SamplingMetadata.from_params(params, indices, CPU, token_ids=history, eos_token_ids=eos,
                                             vocab_size=16, **kw)  # fmt: skip
        assert _same_metadata(got, fresh)
        return got

    first = build(static, [2, 5])
    assert build(static, [3, 6]) is first and build(static, [9, 9]) is first
    assert build(static[::-1], [6, 3]) is not first  # another order is another build
    assert build([static[0], SamplingParams(**vars(static[1]))], [4, 7]) is not first  # equal, not the same
    for params in stepwise:
        rows = [static[0], params]
        assert build(rows, [4, 1]) is not build(rows, [5, 2])
    # A params object shared by a request past min_tokens and a new one: the new one's ban is built.
    build(static, [3, 6])
    assert build(static, [3, 6]).min_tokens_ban is None
    assert build(static, [3, 0]).min_tokens_ban is not None
    grammar = ([0], torch.full((1, 1), -1, dtype=torch.int32))
    assert build(static, [3, 6], grammar=grammar) is not build(static, [3, 6], grammar=grammar)


def test_greedy_is_argmax_with_lowest_index_on_ties(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_random_path(*args: object) -> None:
        raise AssertionError("an all-greedy batch must not touch the random path")

    monkeypatch.setattr(Sampler, "_sample", staticmethod(no_random_path))
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    logits[3, [7, 20]] = 100.0
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids[3].item() == 7
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None


def test_logprobs_are_raw_and_lead_with_the_chosen_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 30) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.5, top_k=4, logprobs=1),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = _sample(logits, params)
    assert out.logprobs is not None and out.logprob_token_ids is not None
    assert out.logprobs.shape == out.logprob_token_ids.shape == (4, 4)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, out.token_ids[:, None]).squeeze(1))
    top_values, top_ids = raw.topk(3, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], top_values)
    assert out.logprobs.dtype == torch.float32


def test_zero_logprobs_gives_the_chosen_token_only() -> None:
    logits = torch.randn(3, 9)
    out = _sample(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 3)
    assert out.logprobs is not None and out.logprobs.shape == (3, 1)
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(logits, -1).max(dim=-1).values)


def test_top_k_never_samples_outside_the_top_k() -> None:
    torch.manual_seed(1)
    row = torch.randn(40)
    allowed = set(row.topk(5).indices.tolist())
    out = _sample(_repeat(row, 4000), [SamplingParams(temperature=1.5, top_k=5)] * 4000)
    assert set(out.token_ids.tolist()) == allowed  # all of them, and only them


def test_top_k_one_is_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(64, 100)
    out = _sample(logits, [SamplingParams(temperature=2.0, top_k=1)] * 64)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_top_k_larger_than_vocab_is_off() -> None:
    torch.manual_seed(3)
    row = torch.zeros(4)
    out = _sample(_repeat(row, 2000), [SamplingParams(top_k=1000)] * 2000)
    assert set(out.token_ids.tolist()) == {0, 1, 2, 3}


def test_top_p_keeps_exactly_the_nucleus() -> None:
    torch.manual_seed(4)
    row = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()
    # Sorted: 0.5, 0.3 | 0.15, 0.05 -> the smallest set reaching 0.75 is {1, 3}.
    out = _sample(_repeat(row, 4000), [SamplingParams(top_p=0.75)] * 4000)
    assert set(out.token_ids.tolist()) == {1, 3}
    tiny = _sample(_repeat(row, 500), [SamplingParams(top_p=0.01)] * 500)
    assert set(tiny.token_ids.tolist()) == {1}  # the top token always survives


def test_top_k_then_top_p() -> None:
    torch.manual_seed(5)
    row = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # Top-2 renormalises to 4/7, 3/7: top_p 0.5 then keeps only token 0.
    out = _sample(_repeat(row, 1000), [SamplingParams(top_k=2, top_p=0.5)] * 1000)
    assert set(out.token_ids.tolist()) == {0}


def test_masked_logits_are_never_sampled() -> None:
    torch.manual_seed(6)
    row = torch.full((1000,), float("-inf"))
    row[[3, 500]] = 0.0
    out = _sample(_repeat(row, 3000), [SamplingParams(temperature=1.0)] * 3000)
    assert set(out.token_ids.tolist()) == {3, 500}


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_softmax(temperature: float) -> None:
    torch.manual_seed(7)  # fixed: the tolerance below is ~8 standard deviations, but never flaky
    row = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -1.0])
    n = 40_000
    out = _sample(_repeat(row, n), [SamplingParams(temperature=temperature)] * n)
    empirical = torch.bincount(out.token_ids, minlength=6).float() / n
    expected = torch.softmax(row / temperature, dim=-1)
    torch.testing.assert_close(empirical, expected, atol=0.02, rtol=0)


def _seeded_run(seed: int, row: int, batch: int, steps: int, global_seed: int) -> list[int]:
    """Tokens a seeded request draws at `row` of a batch full of other random requests."""
    torch.manual_seed(global_seed)
    tokens = []
    for step in range(steps):
        logits = torch.zeros(batch, 500)  # flat: every token equally likely, the noise decides
        params = [
            SamplingParams(temperature=1.0, seed=100 + i) if i % 3 == 0 else SamplingParams()
            for i in range(batch)
        ]
        params[row] = SamplingParams(temperature=0.8, seed=seed, top_p=0.999)
        indices = [(step * 7 + i) % 5 for i in range(batch)]
        indices[row] = step
        tokens.append(int(_sample(logits, params, indices).token_ids[row]))
    return tokens


def test_seeded_row_is_reproducible_alone_or_in_any_batch_position() -> None:
    alone = _seeded_run(seed=42, row=0, batch=1, steps=20, global_seed=0)
    in_batch = _seeded_run(seed=42, row=6, batch=10, steps=20, global_seed=123)
    elsewhere = _seeded_run(seed=42, row=2, batch=5, steps=20, global_seed=9)
    assert alone == in_batch == elsewhere
    assert len(set(alone)) > 10  # the output index moves the noise on each step


def test_preempted_seeded_request_resumes_the_same_sequence() -> None:
    full = _seeded_run(seed=5, row=0, batch=1, steps=10, global_seed=0)
    # After a preemption the runner samples output index 6 again: the token must not change.
    meta = SamplingMetadata.from_params([SamplingParams(temperature=0.8, seed=5, top_p=0.999)], [6], CPU)
    assert int(Sampler()(torch.zeros(1, 500), meta).token_ids[0]) == full[6]


def test_different_seeds_differ() -> None:
    a = _seeded_run(seed=1, row=0, batch=1, steps=20, global_seed=0)
    b = _seeded_run(seed=2, row=0, batch=1, steps=20, global_seed=0)
    assert a != b


def test_mixed_greedy_and_random_batch() -> None:
    torch.manual_seed(8)
    logits = torch.randn(6, 200)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.0, seed=2),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.7, top_p=0.3, logprobs=2),
        SamplingParams(temperature=0.0, top_k=3),
    ]
    out = _sample(logits, params)
    greedy = logits.argmax(dim=-1)
    for row in (0, 2, 3, 5):
        assert out.token_ids[row] == greedy[row]
    probs = torch.softmax(logits[4] / 0.7, dim=-1)
    order = probs.argsort(descending=True)
    nucleus = order[: int((probs[order].cumsum(0) < 0.3).sum()) + 1]
    assert int(out.token_ids[4]) in nucleus.tolist()
    assert out.token_ids.shape == (6,)


def test_no_sort_without_top_k_or_top_p(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object) -> None:
        raise AssertionError("top-k/top-p filtering ran although no row uses it")

    monkeypatch.setattr(sampler_module, "apply_top_k_top_p", forbidden)
    out = _sample(torch.randn(4, 10), [SamplingParams(temperature=1.0, seed=1), SamplingParams()] * 2)
    assert out.token_ids.shape == (4,)
