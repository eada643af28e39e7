"""Every field an OpenAI client sends is honored or refused (issue 20, the API side): the stock `openai`
package against a live server on the tiny model. Sampling fields reach the engine (logit_bias,
stop_token_ids, min_tokens, bad_words, penalties, n), structured outputs and tool choices constrain the
output, /v1/completions, /tokenize, /detokenize and /v1/models/{id} answer in OpenAI's / vLLM's shapes,
and what cannot be served is a 400 / 404 naming the field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest

from mmserve.api import ServerSettings, convert, create_app
from mmserve.api.protocol import ChatCompletionChunk, ChatCompletionRequest
from mmserve.api.server import ServerThread
from mmserve.config import EngineArgs
from mmserve.engine.async_engine import AsyncEngine

KEY = "sk-fields"
HELLO = [{"role": "user", "content": "Describe a red circle on a white background."}]
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Callable[[str], Path]) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(
        EngineArgs(
            str(tiny_model_dir("qwen2_vl")),
            max_num_batched_tokens=128,
            max_model_len=MAX_MODEL_LEN,
            num_kv_blocks=256,
        )
    )
    yield engine
    asyncio.run(engine.shutdown(1.0))


@pytest.fixture(scope="module")
def server(engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = ServerSettings(
        api_key=KEY, data_dir=tmp_path_factory.mktemp("fields-data"), served_model_name=("tiny", "tiny-alias")
    )
    live = ServerThread(lambda: create_app(engine, settings))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def word(engine: AsyncEngine) -> tuple[int, str]:
    """A token that is a plain word piece (no special token), and its text."""
    token_id = engine.tokenizer("hello", add_special_tokens=False)["input_ids"][0]
    return token_id, engine.tokenizer.decode([token_id])


def greedy(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "temperature": 0, **extra}


def completion_ids(oai: openai.OpenAI, **kwargs: Any) -> tuple[list[str], str | None]:
    """The tokens (as text) of a one-prompt completion, and its finish reason."""
    out = oai.completions.create(model="tiny", prompt=[1, 2, 3, 4], temperature=0, logprobs=0, **kwargs)
    choice = out.choices[0]
    return choice.logprobs.tokens, choice.finish_reason


# --------------------------------------------------------------------------------- sampling fields


def test_logit_bias_stop_token_ids_and_min_tokens_reach_the_engine(
    oai: openai.OpenAI, word: tuple[int, str]
) -> None:
    token_id, text = word
    tokens, reason = completion_ids(oai, max_tokens=6, logit_bias={str(token_id): 100},
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert tokens == [text] * 6 and reason == "length"
    # The forced token stops the request at once ...
    tokens, reason = completion_ids(oai, max_tokens=6, logit_bias={str(token_id): 100},
                                    extra_body={"stop_token_ids": [token_id]})  # fmt: skip
    assert tokens == [text] and reason == "stop"
    # ... but not before min_tokens: it is banned until then.
    tokens, reason = completion_ids(oai, max_tokens=8, logit_bias={str(token_id): 100},
                                    extra_body={"stop_token_ids": [token_id], "min_tokens": 3})  # fmt: skip
    assert len(tokens) == 4 and tokens[-1] == text and text not in tokens[:3] and reason == "stop"


def test_bad_words_and_penalties_change_the_output(oai: openai.OpenAI, word: tuple[int, str]) -> None:
    token_id, text = word
    tokens, _ = completion_ids(oai, max_tokens=4, logit_bias={str(token_id): 5},
                               extra_body={"ignore_eos": True, "bad_words": [text]})  # fmt: skip
    assert text not in tokens
    base, _ = completion_ids(oai, max_tokens=12, extra_body={"ignore_eos": True})
    for extra in ({"repetition_penalty": 2.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        kwargs = {k: v for k, v in extra.items() if k != "repetition_penalty"}
        body = {"ignore_eos": True, **{k: v for k, v in extra.items() if k == "repetition_penalty"}}
        penalized, _ = completion_ids(oai, max_tokens=12, extra_body=body, **kwargs)
        if len(set(base)) < len(base):  # the greedy output repeats a token: a penalty must change it
            assert penalized != base, extra


def test_n_choices_json_and_stream_prefill_once(oai: openai.OpenAI, engine: AsyncEngine) -> None:
    # A prompt no earlier test sent (several blocks long), so only this request can have cached it.
    long = [{"role": "user", "content": "count the sides of every polygon you know " * 10}]
    before = engine.stats()
    done = oai.chat.completions.create(model="tiny", messages=long, max_tokens=4, n=3, temperature=1.0,
                                       seed=7, extra_body={"ignore_eos": True})  # fmt: skip
    assert sorted(c.index for c in done.choices) == [0, 1, 2]
    assert done.usage.completion_tokens == 12
    prompt_tokens = done.usage.prompt_tokens
    after = engine.stats()
    # Prompt tokens computed = looked up in the prefix cache and missed: one prompt (the forks share its
    # blocks, recomputing at most the last one each), not three.
    computed = (after.prefix_cache_queries - before.prefix_cache_queries) - (
        after.prefix_cache_hits - before.prefix_cache_hits
    )
    assert prompt_tokens > 100 and computed <= prompt_tokens + 2 * 16, (computed, prompt_tokens)
    stream = oai.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, n=3, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})  # fmt: skip
    text: dict[int, str] = {}
    finished, usage = set(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2} and usage is not None and usage.completion_tokens == 9
    assert (
        usage.prompt_tokens
        == oai.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1).usage.prompt_tokens
    )


def _rendered_by_the_models(event: str) -> str:
    """The event a streamed chat chunk is, rendered again through the protocol models as the route's
    reference path renders it (exclude_none, then null logprobs and finish_reason on every choice)."""
    data = json.loads(event)
    usage = data.pop("usage", "absent")
    again = ChatCompletionChunk.model_validate(data).model_dump(exclude_none=True)
    if usage != "absent":
        again["usage"] = usage
    for choice in again["choices"]:
        choice.setdefault("logprobs", None)
        choice.setdefault("finish_reason", None)
    return json.dumps(again, separators=(",", ":"))


@pytest.mark.parametrize("stream_options", [None, {"include_usage": True}, {"include_usage": True,
                         "continuous_usage_stats": True}])  # fmt: skip
def test_streamed_chat_events_are_what_the_models_render(http: httpx.Client, stream_options: dict | None) -> None:
    # Content deltas are rendered from a per-choice template (serving.text_event), the other events through
    # the models: every event must be byte for byte what the models give, whatever the text holds.
    body = greedy(messages=[{"role": "user", "content": 'quote " backslash \\ tab \t é 😀 \u2028'}],
                  max_tokens=24, n=2, temperature=1.0, seed=3, ignore_eos=True, stream=True,
                  service_tier="default")  # fmt: skip
    if stream_options is not None:
        body["stream_options"] = stream_options
    events = []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(line[len("data: ") :])
    content = [json.loads(e) for e in events if any(c["delta"].get("content") for c in json.loads(e)["choices"])]
    assert len(content) >= 4 and {c["choices"][0]["index"] for c in content} == {0, 1}
    for event in events:
        assert event == _rendered_by_the_models(event)
    assert all(json.loads(e)["service_tier"] == "default" for e in events)
    if stream_options is not None:
        assert all("usage" in json.loads(e) for e in events)


def test_text_event_template_equals_its_render() -> None:
    from mmserve.api import serving

    def render(text: str) -> str:
        return serving.sse({"id": "chatcmpl-1", "model": "m\u00e9", "choices": [{"index": 3, "delta": {"content": text}}],
                            "usage": None})  # fmt: skip

    event = serving.text_event(render)
    texts = ["a", " hello", '"', "\\", "\n\t\r", "\x00\x1f", "é", "😀", "\u2028\u2029", "</script>", "\ud800"]
    for text in [*texts, "".join(texts)]:
        assert event(text) == render(text)
    # A render that shows its text twice (or not at all) cannot be a template: it is used as it is.
    assert serving.text_event(lambda t: json.dumps(t) * 2)("x") == '"x""x"'
    assert serving.text_event(lambda t: "fixed")("x") == "fixed"


def test_cached_tokens_on_a_repeated_long_prompt(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "a long prompt about circles and squares " * 12}]
    first = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    again = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert first.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    stream = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=3, stream=True,
                                         stream_options={"include_usage": True, "continuous_usage_stats": True},
                                         extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks[1:])  # vLLM's continuous usage: on every chunk
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 32


# --------------------------------------------------------------------------- structured outputs, tools


class Point(pydantic.BaseModel):
    # Bounded, so random weights under the grammar finish within max_tokens.
    x: int = pydantic.Field(ge=0, le=999)
    y: int = pydantic.Field(ge=0, le=999)
    label: str = pydantic.Field(max_length=8)


def test_response_format_json_schema_parses_into_the_model(oai: openai.OpenAI) -> None:
    done = oai.chat.completions.parse(model="tiny", messages=HELLO, response_format=Point, max_tokens=80)
    assert done.choices[0].finish_reason == "stop", done.choices[0].message.content
    assert isinstance(done.choices[0].message.parsed, Point)
    obj = oai.chat.completions.create(model="tiny", messages=HELLO, max_tokens=60,
                                      response_format={"type": "json_object"})  # fmt: skip
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = oai.chat.completions.create(model="tiny", messages=HELLO, max_tokens=10,
                                         extra_body={"guided_choice": ["yes", "no"]})  # fmt: skip
    assert choice.choices[0].message.content in ("yes", "no")


# Closed (no additional properties): the grammar must end the arguments after the city, so a random model's
# call completes within the test's max_tokens whichever near-tied tokens its greedy path takes.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
                         "additionalProperties": False}}}]  # fmt: skip


def test_named_tool_choice_is_a_tool_call_json_and_stream(oai: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    done = oai.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, tool_choice=choice,
                                       max_tokens=60, parallel_tool_calls=False)  # fmt: skip
    c = done.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(
        json.loads(call.function.arguments)["city"], str
    )
    stream = oai.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, tool_choice=choice,
                                         max_tokens=60, parallel_tool_calls=False, stream=True)  # fmt: skip
    name, arguments, reasons = None, "", []
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                name = d.function.name or name
                arguments += d.function.arguments or ""
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert name == "get_weather" and "city" in json.loads(arguments) and reasons == ["tool_calls"]


def test_tool_call_history_reaches_the_template(http: httpx.Client) -> None:
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    response = http.post("/v1/chat/completions", json=greedy(messages=messages, tools=TOOLS, max_tokens=2))
    assert response.status_code == 200, response.text
    tokens = http.post("/tokenize", json={"model": "tiny", "messages": messages, "tools": TOOLS}).json()
    assert tokens["count"] == response.json()["usage"]["prompt_tokens"]


# ------------------------------------------------------------------------------------ chat template


def test_chat_template_options(http: httpx.Client, engine: AsyncEngine) -> None:
    messages = [*HELLO, {"role": "assistant", "content": "Once upon"}]
    open_ = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                         "continue_final_message": True}).json()  # fmt: skip
    assert engine.tokenizer.decode(open_["tokens"]).endswith("assistant\nOnce upon")
    both = http.post(
        "/v1/chat/completions", json=greedy(messages=messages, continue_final_message=True, max_tokens=2)
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    cont = http.post("/v1/chat/completions", json=greedy(messages=messages, continue_final_message=True,
                                                          add_generation_prompt=False, max_tokens=2))  # fmt: skip
    assert cont.status_code == 200 and cont.json()["usage"]["prompt_tokens"] == open_["count"]
    template = "{{ messages[0]['content'] }}{{ suffix }}"
    own = http.post("/tokenize", json={"messages": HELLO, "chat_template": template,
                                       "chat_template_kwargs": {"suffix": "!"}}).json()  # fmt: skip
    plain = http.post("/tokenize", json={"prompt": HELLO[0]["content"] + "!"}).json()
    assert own["tokens"] == plain["tokens"]
    chat = http.post("/v1/chat/completions", json=greedy(messages=HELLO, chat_template=template, max_tokens=1,
                                                          chat_template_kwargs={"suffix": "!"}))  # fmt: skip
    assert chat.json()["usage"]["prompt_tokens"] == plain["count"]


# ------------------------------------------------------------------------------------------ endpoints


def test_completions_n_per_prompt(oai: openai.OpenAI) -> None:
    done = oai.completions.create(model="tiny", prompt=["Hello there", "A red circle"], n=2, max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in done.choices] == [0, 1, 2, 3]  # prompt k's sequence i is choice k * n + i
    assert done.choices[0].text == done.choices[1].text  # greedy: both sequences of prompt 0 agree
    assert done.usage.completion_tokens == 12


def test_completions_prompts_echo_logprobs_and_stream(oai: openai.OpenAI) -> None:
    done = oai.completions.create(model="tiny", prompt=["Hello there", [5, 6, 7]], max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in done.choices] == [0, 1]
    alone = oai.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    assert done.choices[1].text == alone.choices[0].text
    assert done.usage.completion_tokens == 6
    hello = oai.completions.create(model="tiny", prompt="Hello there", max_tokens=1)
    assert (
        done.usage.prompt_tokens == alone.usage.prompt_tokens + hello.usage.prompt_tokens
    )  # each prompt once
    echo = oai.completions.create(model="tiny", prompt="Hello there", max_tokens=3, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert echo.choices[0].text == "Hello there" + done.choices[0].text
    lp = oai.completions.create(model="tiny", prompt="Hello there", max_tokens=3, temperature=0, logprobs=2,
                                extra_body={"ignore_eos": True})  # fmt: skip
    logprobs = lp.choices[0].logprobs
    assert "".join(logprobs.tokens) == lp.choices[0].text and len(logprobs.token_logprobs) == 3
    assert logprobs.text_offset[0] == 0 and all(len(t) <= 2 for t in logprobs.top_logprobs)
    stream = oai.completions.create(model="tiny", prompt="Hello there", max_tokens=3, temperature=0, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].usage.completion_tokens == 3
    default = oai.completions.create(model="tiny", prompt=[5, 6, 7], extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # the legacy API's default max_tokens


def test_tokenize_detokenize_round_trip_and_models(http: httpx.Client, oai: openai.OpenAI) -> None:
    tokens = http.post("/tokenize", json={"model": "tiny", "prompt": "Hello there, circle"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = http.post("/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello there, circle"}
    chat = http.post("/tokenize", json={"messages": HELLO}).json()
    usage = oai.chat.completions.create(model="tiny", messages=HELLO, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert [m.id for m in oai.models.list().data] == ["tiny", "tiny-alias"]
    assert oai.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError) as missing:
        oai.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found"
    alias = oai.chat.completions.create(model="tiny-alias", messages=HELLO, max_tokens=1)
    assert alias.model == "tiny"  # responses echo the first name


# --------------------------------------------------------------------------------------------- refusals


def test_refusals_name_the_field(oai: openai.OpenAI, http: httpx.Client) -> None:
    def refused(call: Callable[[], Any], error: type[openai.APIStatusError], param: str | None,
                code: str | None = None) -> None:  # fmt: skip
        with pytest.raises(error) as caught:
            call()
        assert caught.value.param == param, caught.value.body
        if code is not None:
            assert caught.value.code == code

    chat = oai.chat.completions.create
    refused(lambda: chat(model="gpt-4o", messages=HELLO), openai.NotFoundError, "model", "model_not_found")
    refused(lambda: chat(model="tiny", messages=HELLO, audio={"voice": "alloy", "format": "wav"}),
            openai.BadRequestError, "audio", "unsupported_parameter")  # fmt: skip
    refused(lambda: chat(model="tiny", messages=HELLO, modalities=["text", "audio"]), openai.BadRequestError,
            "modalities")  # fmt: skip
    refused(lambda: chat(model="tiny", messages=HELLO, prediction={"type": "content", "content": "x"}),
            openai.BadRequestError, "prediction")  # fmt: skip
    refused(lambda: chat(model="tiny", messages=HELLO, web_search_options={}), openai.BadRequestError,
            "web_search_options")  # fmt: skip
    refused(lambda: chat(model="tiny", messages=HELLO, functions=[{"name": "f"}]), openai.BadRequestError,
            "functions")  # fmt: skip
    refused(lambda: chat(model="tiny", messages=HELLO, max_tokens=MAX_MODEL_LEN), openai.BadRequestError,
            "max_tokens")  # fmt: skip
    refused(lambda: chat(model="tiny", messages=HELLO, tool_choice="required"), openai.BadRequestError,
            "tool_choice")  # fmt: skip
    refused(lambda: chat(model="tiny", messages=HELLO, n=1000), openai.BadRequestError, "n")
    refused(lambda: chat(model="tiny", messages=HELLO, logit_bias={"5": 500}), openai.BadRequestError,
            "logit_bias")  # fmt: skip
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    refused(lambda: chat(model="tiny", messages=HELLO, response_format=bad_schema, max_tokens=2),
            openai.BadRequestError, "structured_outputs.json")  # fmt: skip
    refused(lambda: chat(model="tiny", messages=HELLO, response_format={"type": "json_object"},
                         extra_body={"guided_regex": "a+"}), openai.BadRequestError, "guided_regex")  # fmt: skip
    cmpl = oai.completions.create
    refused(lambda: cmpl(model="tiny", prompt="x", suffix="y"), openai.BadRequestError, "suffix")
    refused(lambda: cmpl(model="tiny", prompt="x", best_of=2), openai.BadRequestError, "best_of")
    refused(lambda: cmpl(model="tiny", prompt="x", logprobs=21), openai.BadRequestError, "logprobs")
    refused(lambda: cmpl(model="nope", prompt="x"), openai.NotFoundError, "model", "model_not_found")
    # Harmless OpenAI fields are accepted, and every service tier the SDK sends.
    for tier in ("auto", "default", "flex", "scale", "priority"):
        done = chat(model="tiny", messages=HELLO, max_tokens=1, service_tier=tier, store=False,
                    metadata={"k": "v"}, user="u")  # fmt: skip
        assert done.choices[0].finish_reason in ("length", "stop")
    typo = http.post("/v1/chat/completions", json=greedy(
        messages=[{"role": "user", "content": [{"type": "image-url", "image_url": {"url": "x"}}]}]))  # fmt: skip
    message = typo.json()["error"]["message"]
    assert "'image-url'" in message and "image_url" in message and "valid string" not in message, message


# ---------------------------------------------------------------------------------- no server needed


def test_generation_config_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.01,
                "top_k": 1,
                "top_p": 0.001,
                "repetition_penalty": 1.05,
                "min_p": 0.1,
                "do_sample": True,
            }
        )
    )
    defaults = convert.generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.01, "top_k": 1, "top_p": 0.001, "repetition_penalty": 1.05}
    body = ChatCompletionRequest.model_validate({"messages": HELLO})
    params = convert.sampling_params(body, 100, defaults)
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (
        0.01,
        1,
        0.001,
        1.05,
    )
    own = convert.sampling_params(ChatCompletionRequest.model_validate({"messages": HELLO, "temperature": 0.5}),
                                  100, defaults)  # fmt: skip
    assert own.temperature == 0.5 and own.top_k == 1
    assert convert.sampling_params(body, 100, {}).temperature == 1.0  # --generation-config vllm
    assert convert.generation_defaults(tmp_path / "missing") == {}
