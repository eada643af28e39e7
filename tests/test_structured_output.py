"""Constrained decoding (llguidance) through the whole engine on a tiny random checkpoint: random weights
plus a grammar must still give output the grammar accepts, through chunked prefill, preemption and
prefix caching, next to unconstrained requests that it must not affect."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest

from mmserve import LLM, SamplingParams
from mmserve.engine import structured_output
from mmserve.errors import InvalidRequestError
from mmserve.request import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Describe the pet:", "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3, "JSON please"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Callable[[str], Path]) -> Iterator[LLM]:
    with LLM(tiny_model_dir("qwen2"), max_num_batched_tokens=64) as engine:
        yield engine


def constrained(spec: StructuredOutputs, max_tokens: int = 120, **kw: object) -> SamplingParams:
    fields: dict = {"temperature": 0.0, **kw}
    return SamplingParams(max_tokens=max_tokens, structured_outputs=spec, **fields)


def test_check_accepts_what_compiles_and_names_what_does_not() -> None:
    structured_output.check(StructuredOutputs(json=json.dumps(SCHEMA)))
    structured_output.check(StructuredOutputs(regex=r"\d{3}-[a-z]+"))
    structured_output.check(StructuredOutputs(grammar='start: "yes" | "no"'))  # Lark
    structured_output.check(StructuredOutputs(grammar='root ::= "yes" | "no"'))  # GBNF
    cases = [
        (StructuredOutputs(json='{"type": "frobnicate"}'), "structured_outputs.json"),
        (StructuredOutputs(json="{not json"), "structured_outputs.json"),
        (StructuredOutputs(regex="(unclosed"), "structured_outputs.regex"),
        (StructuredOutputs(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    ]
    for spec, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            structured_output.check(spec)
        assert info.value.param == param and "cannot compile" in str(info.value)
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs(json="{}", regex="a")


def test_a_bad_schema_is_refused_before_the_engine_sees_it(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("x", constrained(StructuredOutputs(json='{"type": 7}')))
    assert info.value.param == "structured_outputs.json"
    assert llm.engine.leak_report()["requests"] == 0


def test_random_weights_under_a_schema_give_valid_json(llm: LLM) -> None:
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    outs = llm.generate(PROMPTS, [constrained(spec, seed=i, temperature=1.0) for i in range(len(PROMPTS))])
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.finish_reason == "stop"
    assert llm.engine.leak_report()["grammar_matchers"] == 0


def test_choice_regex_grammar_and_json_object(llm: LLM) -> None:
    specs = [
        StructuredOutputs(choice=("red", "green", "blue")),
        StructuredOutputs(regex=r"[0-9]{3}-[a-c]{2}"),
        StructuredOutputs(grammar='start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]/'),
        StructuredOutputs(json_object=True),
    ]
    outs = llm.generate(["pick one"] * len(specs), [constrained(s, max_tokens=200) for s in specs])
    assert outs[0].text in {"red", "green", "blue"}
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", outs[1].text)
    assert re.fullmatch(r"yes|no|maybe [0-9]", outs[2].text)
    assert isinstance(json.loads(outs[3].text), dict)


def test_constrained_rows_leave_their_neighbours_untouched(llm: LLM) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain)
    spec = StructuredOutputs(regex="[a-z ]{1,30}")
    mixed = llm.generate(PROMPTS * 2, [plain] * len(PROMPTS) + [constrained(spec)] * len(PROMPTS))
    assert [o.token_ids for o in mixed[: len(PROMPTS)]] == [o.token_ids for o in alone]
    assert all(re.fullmatch("[a-z ]{1,30}", o.text) for o in mixed[len(PROMPTS) :])
    # The constraint really bites: greedy output without it is not all lower-case letters and spaces.
    free = llm.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0.0))
    assert any(not re.fullmatch("[a-z ]{1,30}", o.text) for o in free)


def test_constrained_output_is_the_same_through_chunking_preemption_and_prefix_hits(
    llm: LLM, tiny_model_dir: Callable[[str], Path]
) -> None:
    """The matcher follows the tokens a request keeps: a preempted request resumes where it was."""
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    params = [constrained(spec, seed=i, temperature=1.0) for i in range(6)]
    prompts = [PROMPTS[1]] * 6  # one long shared prompt: prefix-cache hits after the first
    reference = [o.text for o in llm.generate(prompts, params)]
    # 8-token chunks and a pool too small for six sequences: chunked prefills and preemptions.
    with LLM(
        tiny_model_dir("qwen2"), max_num_batched_tokens=8, num_kv_blocks=40, block_size=4
    ) as small:
        outs = small.generate(prompts, params)
        assert small.stats().num_preemptions > 0
        assert small.stats().prefix_cache_hits > 0
        assert small.engine.leak_report()["grammar_matchers"] == 0
    assert [o.text for o in outs] == reference
    for text in reference:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_grammar_that_completes_ends_the_request_even_with_ignore_eos(llm: LLM) -> None:
    (out,) = llm.generate("x", constrained(StructuredOutputs(choice=("done",)), ignore_eos=True))
    assert out.text == "done" and out.finish_reason == "stop"


def test_n_sequences_share_the_prompt_and_each_obeys_the_grammar(tiny_model_dir: Callable[[str], Path]) -> None:
    spec = StructuredOutputs(regex="[a-z]{4,8}")
    # Without prefix caching, the only prompt tokens not computed are those the forks share.
    with LLM(tiny_model_dir("qwen2"), max_num_batched_tokens=64, enable_prefix_caching=False) as engine:
        outs = engine.generate(PROMPTS[1], constrained(spec, n=3, temperature=1.0, seed=5))
        hits = engine.stats().prefix_cache_hits
        assert engine.engine.leak_report()["kv_blocks_held"] == 0
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(re.fullmatch("[a-z]{4,8}", o.text) for o in outs)
    assert len({o.text for o in outs}) > 1  # seeds 5, 6, 7: different sequences
    num_prompt = len(outs[0].prompt_token_ids)
    assert hits == 2 * ((num_prompt - 1) // 16) * 16 > 0  # two forks, every full prompt block each
