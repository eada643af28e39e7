"""Tool calling's model side: hermes / qwen3_xml parsing (whole and streamed), the tool_choice grammar under a
real tokenizer with llguidance, and the chat templates' tool rendering."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import llguidance
import llguidance.hf
import numpy as np
import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from mmserve.api.tool_parsers import (
    TOOL_PARSERS,
    ParsedMessage,
    StreamDelta,
    default_tool_parser,
    get_tool_parser,
    tool_choice_constraint,
)
from mmserve.errors import InvalidRequestError
from mmserve.tiny_model import CHAT_TEMPLATE, PRESETS, build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ID = re.compile(r"^call_[0-9a-f]{24}$")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 5},
                "exact": {"type": "boolean"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            },
            "required": ["query", "exact"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]

HERMES_TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par{is}"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"query": "a</tool_call>\\"b", "exact": true, "tags": ["a"]}}\n'
    "</tool_call>",
    '<tool_call>\n{"arguments": {"query": "x", "exact": false}, "name": "search"}\n</tool_call>',  # other key order
    '<tool_call>{"name":"search","arguments":{}}</tool_call>',  # compact, no newlines
    '<tool_call>\n{"name": "search", "arguments": {"query": "é😀"}}',  # unterminated at the end: still a call
    "No tool needed <b>here</b> <tool_ call> x < y.\n",
    "   \n",
]
XML_TEXTS = [
    "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    '<tool_call>\n<function=search>\n<parameter=query>\nline1\nline2 </param "q"\n\n</parameter>\n'
    '<parameter=exact>\nTrue\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n</function>\n'
    "</tool_call>\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\n\n</parameter>\n</function>\n</tool_call>",
    "plain text only",
]


def pieces(text: str, rng: random.Random) -> Iterator[str]:
    i = 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13])
        yield text[i : i + n]
        i += n


def run_stream(parser: str, text: str, seed: int, tools: list[dict] | None = None) -> list[StreamDelta]:
    s = get_tool_parser(parser).stream(tools=tools)
    return [s.feed(p) for p in pieces(text, random.Random(seed))] + [s.finish()]


def collect(deltas: list[StreamDelta]) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) from deltas, checking the fragment rules on the way."""
    content = "".join(d.content or "" for d in deltas) or None
    calls: list[list[str]] = []
    for d in deltas:
        for c in d.tool_calls:
            if c.id is not None:
                assert ID.match(c.id) and c.name and c.index == len(calls)
                calls.append([c.name, c.arguments])
            else:
                assert c.name is None and c.index == len(calls) - 1  # fragments follow their call's first one
                calls[c.index][1] += c.arguments
    return content, [(n, a) for n, a in calls]


def summary(msg: ParsedMessage) -> tuple[str | None, list[tuple[str, str]]]:
    assert all(ID.match(c.id) for c in msg.tool_calls)
    assert len({c.id for c in msg.tool_calls}) == len(msg.tool_calls)
    return msg.content, [(c.name, c.arguments) for c in msg.tool_calls]


# ------------------------------------------------------------------------------------------- hermes parsing


def test_hermes_parse() -> None:
    p = get_tool_parser("hermes")
    assert p.name == "hermes"
    assert summary(p.parse(HERMES_TEXTS[0])) == (
        "Let me check.",
        [("get_weather", '{"city": "Paris", "days": 2}')],
    )
    content, calls = summary(p.parse(HERMES_TEXTS[1]))
    assert content is None and [n for n, _ in calls] == ["get_weather", "search"]
    assert json.loads(calls[1][1]) == {"query": 'a</tool_call>"b', "exact": True, "tags": ["a"]}
    assert summary(p.parse(HERMES_TEXTS[2])) == (None, [("search", '{"query": "x", "exact": false}')])
    assert summary(p.parse(HERMES_TEXTS[3])) == (None, [("search", "{}")])
    assert summary(p.parse(HERMES_TEXTS[4])) == (None, [("search", '{"query": "é😀"}')])
    assert summary(p.parse(HERMES_TEXTS[5])) == (HERMES_TEXTS[5], [])
    assert summary(p.parse(HERMES_TEXTS[6])) == (None, [])
    assert summary(p.parse("")) == (None, [])
    # Lenient: what follows the arguments object up to </tool_call> is not checked (here the outer brace is missing).
    assert summary(p.parse('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call> ok')) == (
        "ok",
        [("f", '{"a": 1}')],
    )


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call>',  # bad JSON in the arguments
        "Hi <tool_call>not json</tool_call> there",
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
        "<tool_call>\n",
        'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> <tool_call>\n[]\n</tool_call>',
    ],
)
def test_hermes_malformed(text: str) -> None:
    # Non-streamed: the whole text is content, no calls. Streamed: never raises (what it sends is documented).
    assert summary(get_tool_parser("hermes").parse(text)) == (text, [])
    for seed in range(20):
        run_stream("hermes", text, seed)


def test_hermes_malformed_stream_behaviour() -> None:
    # Malformed before the name: passed on as content, verbatim.
    assert collect(run_stream("hermes", "Hi <tool_call>not json</tool_call> there", 0)) == (
        "Hi <tool_call>not json</tool_call> there",
        [],
    )
    # Malformed after the name: the call stays with the argument text streamed so far; the rest up to
    # </tool_call> is dropped and text after it is content again.
    content, calls = collect(
        run_stream("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1 <x> </tool_call>ok', 0)
    )
    assert content == "ok" and calls == [("f", '{"a": 1 ')]


def test_hermes_stream_order_and_holdback() -> None:
    s = get_tool_parser("hermes").stream()
    assert s.feed("Hello <b>") == StreamDelta("Hello <b>", [])
    assert s.feed(" and <tool_") == StreamDelta(" and", [])  # a possible "<tool_call>" and whitespace wait
    assert s.feed("x> ") == StreamDelta(" <tool_x>", [])
    d = s.feed('<tool_call>\n{"name": "search", "arguments": {"query"')
    assert d.content is None and len(d.tool_calls) == 1  # the name goes out before the arguments are complete
    first = d.tool_calls[0]
    assert first.index == 0 and ID.match(first.id or "") and first.name == "search"
    assert first.arguments == '{"query"'
    d = s.feed(': "x"}}\n</tool_call>')
    assert d.content is None and [(c.id, c.name, c.arguments) for c in d.tool_calls] == [
        (None, None, ': "x"}')
    ]
    assert s.finish() == StreamDelta(None, [])
    assert s.feed("late") == StreamDelta(None, [])  # nothing after finish, and no exception


@pytest.mark.parametrize("parser,texts,tools", [("hermes", HERMES_TEXTS, None), ("qwen3_xml", XML_TEXTS, TOOLS),
                                                ("qwen3_xml", XML_TEXTS, None)])  # fmt: skip
def test_stream_matches_parse(parser: str, texts: list[str], tools: list[dict] | None) -> None:
    """Fed in random pieces, the stream's content and argument fragments add up to exactly what parse returns."""
    for text in texts:
        expected = summary(get_tool_parser(parser).parse(text, tools=tools))
        for seed in range(60):
            assert collect(run_stream(parser, text, seed, tools)) == expected, (text, seed)
        whole = get_tool_parser(parser).stream(tools=tools)
        assert collect([whole.feed(text), whole.finish()]) == expected


# ---------------------------------------------------------------------------------------- qwen3_xml parsing


def test_qwen3_xml_parse_typed_by_schema() -> None:
    p = get_tool_parser("qwen3_xml")
    assert p.name == "qwen3_xml"
    content, calls = summary(p.parse(XML_TEXTS[1], tools=TOOLS))
    assert content is None and [n for n, _ in calls] == ["search", "get_weather"]
    assert json.loads(calls[0][1]) == {
        "query": 'line1\nline2 </param "q"\n',
        "exact": True,
        "tags": ["a", "b"],
    }
    assert calls[1][1] == "{}"
    assert summary(p.parse(XML_TEXTS[0], tools=TOOLS)) == (
        "I will look.",
        [("get_weather", '{"city": "Paris", "days": 3}')],
    )
    assert summary(p.parse(XML_TEXTS[2], tools=TOOLS)) == (None, [("get_weather", '{"city": ""}')])
    # Without schemas a value is JSON where it parses, else text.
    _, calls = summary(p.parse(XML_TEXTS[1]))
    assert json.loads(calls[0][1]) == {
        "query": 'line1\nline2 </param "q"\n',
        "exact": "True",
        "tags": ["a", "b"],
    }
    # A schema's string stays text even when it reads as JSON.
    text = "<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n</function>\n</tool_call>"
    assert summary(p.parse(text, tools=TOOLS))[1] == [("search", '{"query": "42"}')]
    assert summary(p.parse(text))[1] == [("search", '{"query": 42}')]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f"}\n</tool_call>',  # hermes JSON is not this format
        "<tool_call>\n<function=f\n>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",  # </parameter> missing
        "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n",  # ends inside the function
    ],
)
def test_qwen3_xml_malformed(text: str) -> None:
    assert summary(get_tool_parser("qwen3_xml").parse(text, tools=TOOLS)) == (text, [])
    for seed in range(20):
        _, calls = collect(run_stream("qwen3_xml", text, seed, TOOLS))
        for _name, args in calls:  # once a name went out, its arguments are still closed into a JSON object
            assert isinstance(json.loads(args), dict)


def test_parser_registry_and_default() -> None:
    assert TOOL_PARSERS == ("hermes", "qwen3_xml")
    with pytest.raises(ValueError, match="hermes, qwen3_xml"):
        get_tool_parser("mistral")
    coder = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + k + '>\\n' }}"
    assert default_tool_parser(coder) == "qwen3_xml"
    assert default_tool_parser(CHAT_TEMPLATE) == "hermes"
    assert default_tool_parser(None) == "hermes"


# ------------------------------------------------------------------------------------------------- grammars


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    tok = build_tokenizer(PRESETS["tiny"].bpe_vocab)  # the tiny models' byte-level BPE
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer: PreTrainedTokenizerFast) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(tokenizer)


def matches(grammar: str, ll: llguidance.LLTokenizer, tok: PreTrainedTokenizerFast, text: str) -> bool:
    m = llguidance.LLMatcher(ll, grammar, log_level=0)
    return m.consume_tokens(tok.encode(text)) and m.is_accepting() and not m.is_error()


def valid(value: object, schema: dict) -> bool:
    """The JSON-schema keywords the test tools use, by hand (jsonschema is not installed)."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    t = schema.get("type")
    if t == "object":
        if not isinstance(value, dict) or not set(schema.get("required", [])) <= set(value):
            return False
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False and not set(value) <= set(props):
            return False
        return all(valid(v, props[k]) for k, v in value.items() if k in props)
    if t == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if t == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return ok and schema.get("minimum", value) <= value <= schema.get("maximum", value)  # type: ignore[operator]
    if t == "boolean":
        return isinstance(value, bool)
    if t == "array":
        items = schema.get("items", {})
        ok = isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
        return ok and all(valid(v, items) for v in value)  # type: ignore[union-attr]
    return t is None


VALID = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
    "qwen3_xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>",
}
SECOND = {
    "hermes": '\n<tool_call>\n{"name": "search", "arguments": {"query": "cats", "exact": false}}\n</tool_call>',
    "qwen3_xml": "\n<tool_call>\n<function=search>\n<parameter=query>\ncats\n</parameter>\n"
    "<parameter=exact>\nFalse\n</parameter>\n</function>\n</tool_call>",
}
INVALID = {
    "hermes": [
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # not a tool
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>',  # wrong type
        '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>',  # required missing
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Parisxx"}}\n</tool_call>',  # too long
        'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',  # text first
    ],
    "qwen3_xml": [
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n9\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\nk\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParisxx\n</parameter>\n</function>\n</tool_call>",
    ],
}


@pytest.mark.parametrize("parser", TOOL_PARSERS)
def test_constraint_accepts_and_refuses(
    parser: str, tokenizer: PreTrainedTokenizerFast, ll_tokenizer: llguidance.LLTokenizer
) -> None:
    one = tool_choice_constraint(TOOLS, "required", parser, parallel_tool_calls=False).grammar
    many = tool_choice_constraint(TOOLS, "required", parser, parallel_tool_calls=True).grammar
    named = tool_choice_constraint(
        TOOLS, {"type": "function", "function": {"name": "search"}}, parser, True
    ).grammar
    for g in (one, many, named):
        assert g is not None and llguidance.LLMatcher.validate_grammar(g, ll_tokenizer) == ""
    assert one is not None and many is not None and named is not None
    assert matches(one, ll_tokenizer, tokenizer, VALID[parser])
    assert not matches(one, ll_tokenizer, tokenizer, VALID[parser] + SECOND[parser])  # one call only
    assert matches(many, ll_tokenizer, tokenizer, VALID[parser] + SECOND[parser])
    assert not matches(named, ll_tokenizer, tokenizer, VALID[parser])  # only "search" is allowed
    assert matches(named, ll_tokenizer, tokenizer, SECOND[parser].lstrip("\n"))
    for text in INVALID[parser]:
        assert not matches(one, ll_tokenizer, tokenizer, text), text
    # The text the grammar accepts is what the parser reads back.
    content, calls = summary(get_tool_parser(parser).parse(VALID[parser] + SECOND[parser], tools=TOOLS))
    assert content is None and [json.loads(a) for _, a in calls] == [
        {"city": "Paris", "unit": "c"},
        {"query": "cats", "exact": False},
    ]


@pytest.mark.parametrize("parser", TOOL_PARSERS)
@pytest.mark.parametrize("parallel", [False, True])
def test_random_sampling_under_the_mask_yields_valid_calls(
    parser: str, parallel: bool, tokenizer: PreTrainedTokenizerFast, ll_tokenizer: llguidance.LLTokenizer
) -> None:
    grammar = tool_choice_constraint(TOOLS, "required", parser, parallel).grammar
    assert grammar is not None
    eos = tokenizer.eos_token_id
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(12):
        rng = np.random.default_rng(seed)
        m = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        out: list[int] = []
        while not m.is_stopped() and len(out) < 600:
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[: ll_tokenizer.vocab_size])
            assert allowed.size, m.get_error()
            token = int(rng.choice(allowed))
            assert m.consume_token(token), m.get_error()
            out.append(token)
        assert m.is_stopped() and not m.is_error(), (seed, tokenizer.decode(out))
        text = tokenizer.decode([t for t in out if t != eos])
        content, calls = summary(get_tool_parser(parser).parse(text, tools=TOOLS))
        assert content is None and calls and (parallel or len(calls) == 1), text
        for name, args in calls:
            assert valid(json.loads(args), schemas[name]), (text, args)


def test_constraint_matches_qwen_added_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    # Qwen2.5's vocabulary has <tool_call> / </tool_call> as added, non-special tokens. llguidance treats added
    # tokens as special, so a text literal refuses them: given the added vocabulary the grammar takes both forms.
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer.backend_tokenizer.to_str()), eos_token="<|im_end|>"
    )
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    ll = llguidance.hf.from_tokenizer(tok)
    assert tok.convert_tokens_to_ids("<tool_call>") in tok.encode(VALID["hermes"])
    for parser in TOOL_PARSERS:
        grammar = tool_choice_constraint(
            TOOLS, "required", parser, True, added_tokens=tok.get_added_vocab()
        ).grammar
        assert grammar is not None and llguidance.LLMatcher.validate_grammar(grammar, ll) == ""
        assert matches(grammar, ll, tok, VALID[parser] + SECOND[parser])  # the single tokens
        assert matches(grammar, ll, tokenizer, VALID[parser] + SECOND[parser])  # spelled out
        plain = tool_choice_constraint(TOOLS, "required", parser, True).grammar
        assert plain is not None and not matches(plain, ll, tok, VALID[parser])


def test_constraint_input_errors() -> None:
    with pytest.raises(InvalidRequestError, match="not among the tools") as e:
        tool_choice_constraint(TOOLS, {"type": "function", "function": {"name": "nope"}}, "hermes", False)
    assert e.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        tool_choice_constraint(TOOLS, "auto", "hermes", False)
    with pytest.raises(InvalidRequestError, match="tools"):
        tool_choice_constraint([], "required", "hermes", False)
    with pytest.raises(InvalidRequestError, match=r"tools\[0\]"):
        tool_choice_constraint([{"type": "function"}], "required", "hermes", False)
    with pytest.raises(ValueError, match="hermes, qwen3_xml"):
        tool_choice_constraint(TOOLS, "required", "llama3_json", False)


def test_constraint_schema_corners(
    tokenizer: PreTrainedTokenizerFast, ll_tokenizer: llguidance.LLTokenizer
) -> None:
    tools = [
        {"type": "function", "function": {"name": "ping"}},  # no parameters: an empty object
        {
            "type": "function",
            "function": {
                "name": "paint",
                "description": "grammar ::= text must not read as GBNF",
                "parameters": {
                    "type": "object",
                    "$defs": {"colour": {"enum": ["red", "blue"]}},
                    "properties": {"c": {"$ref": "#/$defs/colour"}},
                    "required": ["c"],
                },
            },
        },
    ]
    for parser, texts in {
        "hermes": [
            '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',
            '<tool_call>\n{"name": "paint", "arguments": {"c": "red"}}\n</tool_call>',
        ],
        "qwen3_xml": [
            "<tool_call>\n<function=ping>\n</function>\n</tool_call>",
            '<tool_call>\n<function=paint>\n<parameter=c>\n"blue"\n</parameter>\n</function>\n</tool_call>',
        ],
    }.items():
        grammar = tool_choice_constraint(tools, "required", parser, False).grammar
        assert grammar is not None and "::=" not in grammar
        assert llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""
        for text in texts:
            assert matches(grammar, ll_tokenizer, tokenizer, text), (parser, text)
        assert not matches(
            grammar, ll_tokenizer, tokenizer, texts[1].replace("red", "green").replace("blue", "green")
        )


# ---------------------------------------------------------------------------------------------- templates

# The template as it was before tool calling (mmserve/tiny_model.py at 857bee8): without tools it must render the same.
_TEMPLATE_BEFORE_TOOLS = r"""{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- elif message['content'] is not none %}
        {%- for part in message['content'] %}
            {%- set kind = part.get('type', '') %}
            {%- if kind in ('image', 'image_url') or 'image' in part or 'image_url' in part %}
                {%- set image_count.value = image_count.value + 1 %}
                {%- if add_vision_id %}{{- 'Picture ' + image_count.value|string + ': ' }}{%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif kind in ('video', 'video_url') or 'video' in part or 'video_url' in part %}
                {%- set video_count.value = video_count.value + 1 %}
                {%- if add_vision_id %}{{- 'Video ' + video_count.value|string + ': ' }}{%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in part %}
                {{- part['text'] }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

IMAGE_CHAT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
CONVERSATIONS = [
    IMAGE_CHAT,
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "video"},
                                     {"type": "video_url", "video_url": {"url": "y"}}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": "ok"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello! "}, {"type": "text", "text": "Yes?"}]},
        {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "image_url"}, {"text": "both?"}]},
        {"role": "assistant", "content": None},
        {"role": "system", "content": "late system"},
        {"role": "user", "content": "é😀 <tool_call> {\"name\": 1}"},
    ],
    [{"role": "system", "content": [{"type": "text", "text": "parts"}]}, {"role": "user", "content": ""}],
]  # fmt: skip


def render(tok: PreTrainedTokenizerFast, template: str, messages: list[dict], **kw: object) -> str:
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)  # type: ignore[return-value]


def test_templates_render_non_tool_chats_as_before(tokenizer: PreTrainedTokenizerFast) -> None:
    assert (ROOT / "assets/demo-model/chat_template.jinja").read_text(encoding="utf-8") == CHAT_TEMPLATE
    for messages in CONVERSATIONS:
        for kw in ({"add_generation_prompt": True}, {"add_generation_prompt": False}, {"add_vision_id": True},
                   {"add_generation_prompt": True, "tools": None}, {"tools": []}):  # fmt: skip
            assert render(tokenizer, CHAT_TEMPLATE, messages, **kw) == render(
                tokenizer, _TEMPLATE_BEFORE_TOOLS, messages, **kw
            ), (messages, kw)


TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]},
    {"role": "assistant", "content": "Paris is sunny, Lyon rainy."},
]  # fmt: skip


def test_template_renders_tools_calls_and_results(tokenizer: PreTrainedTokenizerFast) -> None:
    out = render(tokenizer, CHAT_TEMPLATE, TOOL_CHAT, tools=TOOLS, add_generation_prompt=True)
    tools_json = "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS)
    assert out == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{tools_json}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\nParis is sunny, Lyon rainy.<|im_end|>\n<|im_start|>assistant\n"
    )
    # No system message: the default one carries the tools; a call without content starts the turn.
    out = render(tokenizer, CHAT_TEMPLATE, [TOOL_CHAT[1], {**TOOL_CHAT[2], "content": None}], tools=TOOLS)
    assert out.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    turn = out.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    assert turn.startswith("<tool_call>\n")
    # What the template writes for an assistant's calls is what the hermes parser (and grammar) read.
    assert summary(get_tool_parser("hermes").parse(turn)) == (
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lyon"}')],
    )
    grammar = tool_choice_constraint(TOOLS, "required", "hermes", True).grammar
    ll = llguidance.hf.from_tokenizer(tokenizer)
    assert grammar is not None and matches(grammar, ll, tokenizer, turn)
