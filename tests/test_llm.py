"""The offline `LLM` API end to end on a tiny checkpoint: prompt forms, chat, sampling, stop
conditions, logprobs, policies, validation and metrics. No block may leak after any run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mmserve import LLM, SamplingParams
from mmserve.errors import InvalidRequestError, PromptTooLongError


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen2_vl")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model_dir, max_num_batched_tokens=64)


def assert_no_leak(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == stats.num_waiting == 0


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_prompt_forms_agree(llm: LLM) -> None:
    text = "hello world, this is a test"
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    a, b, c, d = llm.generate([text, ids, {"prompt": text}, {"prompt_token_ids": ids}], GREEDY)
    assert a.token_ids == b.token_ids == c.token_ids == d.token_ids
    assert a.prompt == text and b.prompt is None
    assert a.text == llm.tokenizer.decode(a.token_ids, skip_special_tokens=True)
    single = llm.generate(text, GREEDY)
    assert len(single) == 1 and single[0].token_ids == a.token_ids
    assert_no_leak(llm)


def test_outputs_come_back_in_input_order(llm: LLM) -> None:
    prompts = ["a " * n for n in (30, 1, 12, 5)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 9, 3, 6)]
    outs = llm.generate(prompts, params)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.token_ids) for o in outs] == [1, 9, 3, 6]


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is in the picture?"}]
    (out,) = llm.chat(messages, GREEDY)
    expected = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected and out.prompt.endswith("<|im_start|>assistant\n")
    two = llm.chat([messages, [{"role": "user", "content": "Hi"}]], GREEDY)
    assert two[0].token_ids == out.token_ids and len(two) == 2


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(llm: LLM, model_dir: Path) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate("once upon a time", seeded)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)] * 5
    batch = llm.generate(
        ["x y z", "once upon a time", "q", "r s", "t", "u v w"], [others[0], seeded, *others[1:]]
    )
    assert batch[1].token_ids == alone
    # Also under preemption, in a pool too small for everyone at once.
    small = LLM(model_dir, num_kv_blocks=6, block_size=8, max_num_batched_tokens=16)
    squeezed = small.generate(
        ["x y z " * 5, "once upon a time", "q " * 9, "r s " * 6], [others[0], seeded, others[1], others[2]]
    )
    assert small.stats().num_preemptions > 0
    assert squeezed[1].token_ids == alone
    different = llm.generate("once upon a time", SamplingParams(max_tokens=16, seed=99, ignore_eos=True))[0]
    assert different.token_ids != alone
    assert_no_leak(small)


def test_stop_string_ends_output_before_it(llm: LLM) -> None:
    base = llm.generate("the quick brown fox", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[
        0
    ]
    assert len(base.text) > 6
    stop = base.text[3:6]
    (out,) = llm.generate(
        "the quick brown fox", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    )
    cut = base.text.index(stop)
    assert out.text == base.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(base.token_ids)
    assert_no_leak(llm)


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    base = llm.generate("count with me", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    (out,) = llm.generate(
        "count with me",
        SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_id], ignore_eos=True),
    )
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_logprobs_hold_the_chosen_token_and_top_k(llm: LLM) -> None:
    (out,) = llm.generate(
        "hello", SamplingParams(max_tokens=5, temperature=0.8, seed=3, logprobs=3, ignore_eos=True)
    )
    assert len(out.logprobs) == 5
    for chosen, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert chosen in lp and 3 <= len(lp) <= 4
        assert all(v <= 0.0 for v in lp.values())
    (greedy,) = llm.generate(
        "hello", SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True)
    )
    for chosen, lp in zip(greedy.token_ids, greedy.logprobs, strict=True):
        assert len(lp) == 2 and max(lp, key=lp.get) == chosen  # the chosen token is the top-1
    (none,) = llm.generate("hello", GREEDY)
    assert none.logprobs is None


@pytest.mark.parametrize("policy", ["priority", "no_chunk", "static"])
def test_every_policy_gives_the_same_greedy_output(llm: LLM, model_dir: Path, policy: str) -> None:
    prompts = ["a b c " * n for n in (1, 7, 20, 3)]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    other = LLM(model_dir, scheduler_policy=policy, max_num_batched_tokens=128, max_num_seqs=3)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, priority=p) for p in (3, 1, 2, 0)]
    assert [o.token_ids for o in other.generate(prompts, params)] == expected
    assert_no_leak(other)


def test_slo_policy_and_its_settings_pass_through_to_the_engine(llm: LLM, model_dir: Path) -> None:
    prompts = ["a b c " * n for n in (1, 7, 20, 3)]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    slo = LLM(model_dir, scheduler_policy="slo", max_num_batched_tokens=64, interactive_ttft_ms=250.0,
              interactive_tbt_ms=40.0, step_time_headroom=0.3, max_batch_decode_skips=2)  # fmt: skip
    config = slo.engine.scheduler_config
    assert (config.interactive_slo.ttft_ms, config.interactive_slo.tbt_ms) == (250.0, 40.0)
    assert (config.step_time_headroom, config.max_batch_decode_skips) == (0.3, 2)
    classes = ["batch", "interactive", "batch", "interactive"]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, service_class=c) for c in classes]
    assert [o.token_ids for o in slo.generate(prompts, params)] == expected
    assert_no_leak(slo)
    with pytest.raises(TypeError, match="no_such_setting"):
        LLM(model_dir, no_such_setting=1)


def test_metrics_are_ordered(llm: LLM) -> None:
    (out,) = llm.generate("timing", GREEDY)
    m = out.metrics
    assert m.arrival_time <= m.scheduled_time <= m.first_token_time <= m.last_token_time <= m.finish_time
    assert m.time_to_first_token >= 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"logprobs": 99}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, InvalidRequestError) and info.value.param == field


def test_bad_prompts_are_rejected_and_leave_nothing_queued(llm: LLM) -> None:
    with pytest.raises(PromptTooLongError):
        llm.generate(["fine", [1] * (llm.engine.max_model_len + 5)], GREEDY)
    with pytest.raises(InvalidRequestError, match="outside"):
        llm.generate([[10**9]], GREEDY)
    with pytest.raises(InvalidRequestError):
        llm.generate([""], GREEDY)
    with pytest.raises(InvalidRequestError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY])
    assert_no_leak(llm)
    assert llm.generate("still serving", GREEDY)[0].finish_reason == "length"


def test_invalid_engine_settings_fail_before_loading(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="scheduler_policy"):
        LLM(model_dir, scheduler_policy="lifo")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(model_dir, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(model_dir, dtype="float8")


def test_missing_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="never downloads"):
        LLM(tmp_path / "nowhere")
    with pytest.raises(InvalidRequestError, match="not a checkpoint directory"):
        LLM("Qwen/Qwen2-VL-2B-Instruct")
