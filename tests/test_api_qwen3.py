"""The served API on a Qwen3-VL-MoE checkpoint, through a real uvicorn socket and the stock `openai` package:
an image and a real video clip (timestamps in the prompt) give the offline engine's greedy text, JSON and
streamed alike; the WebSocket agrees; a required tool call comes back parsed with the checkpoint's template
(Qwen3's <tool_call> added token); the engine is idle afterwards."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer
from websockets.sync.client import connect

from mmserve import LLM, SamplingParams
from mmserve.api import ServerSettings, create_app
from mmserve.api.server import ServerThread
from mmserve.config import EngineArgs
from mmserve.engine.async_engine import AsyncEngine

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SETTINGS = {"max_num_batched_tokens": 64, "max_model_len": 4096, "num_kv_blocks": 256}


def _data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


MESSAGES = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": _data_url(ASSETS / "sample.jpg", "image/jpeg")}},
    {"type": "video_url", "video_url": {"url": _data_url(ASSETS / "sample_clip.mp4", "video/mp4")}},
    {"type": "text", "text": "Compare them."},
]}]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("qwen3_vl_moe")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(EngineArgs(str(model_dir), **SETTINGS))
    yield engine
    asyncio.run(engine.shutdown(1.0))


@pytest.fixture(scope="module")
def server(engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    settings = ServerSettings(data_dir=tmp_path_factory.mktemp("data"), served_model_name="qwen3-vl",
                              tool_call_parser="hermes")  # fmt: skip
    live = ServerThread(lambda: create_app(engine, settings))
    yield live
    live.stop()


def test_image_and_video_chat_equals_offline_json_stream_and_websocket(
    server: ServerThread, engine: AsyncEngine, model_dir: Path
) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    greedy = {"model": "qwen3-vl", "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    body = client.chat.completions.create(messages=MESSAGES, **greedy)  # type: ignore[arg-type]
    text = body.choices[0].message.content
    assert body.usage is not None and body.usage.completion_tokens == 8
    stream = client.chat.completions.create(messages=MESSAGES, stream=True, **greedy)  # type: ignore[arg-type]
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with connect(server.url.replace("http", "ws") + "/v1/chat/ws") as ws:
        ws.send(json.dumps({"type": "response.create", "response": {
            "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True}}))  # fmt: skip
        while (event := json.loads(ws.recv()))["type"] != "response.done":
            assert event["type"] != "error", event
    offline = LLM(model_dir, **SETTINGS).chat(
        MESSAGES, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )[0]
    assert text == streamed == event["response"]["output_text"] == offline.text
    # The expanded prompt holds one "<t seconds>" run per temporal group of the clip before its placeholders.
    expanded = AutoTokenizer.from_pretrained(model_dir).decode(offline.prompt_token_ids)
    assert expanded.count(" seconds><|vision_start|><|video_pad|>") >= 2
    deadline = time.monotonic() + 10
    while (stats := engine.stats()).num_free_blocks != stats.num_total_blocks and time.monotonic() < deadline:
        time.sleep(0.05)  # the core publishes its stats after each step
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_referenced_encoder_tokens == 0


def test_required_tool_call_is_parsed(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": "describe", "parameters": {
        "type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
        "required": ["colour"], "additionalProperties": False}}}]  # fmt: skip
    body = client.chat.completions.create(
        model="qwen3-vl", messages=[{"role": "user", "content": "Which colour?"}], tools=tools,  # type: ignore[arg-type]
        tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0,
    )  # fmt: skip
    (call,) = body.choices[0].message.tool_calls or []
    assert body.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "describe" and json.loads(call.function.arguments)["colour"] in ("red", "blue")
