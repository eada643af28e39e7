"""A chat request's fields -> what the engine's `chat()` takes: resolved messages (media, tool calls and
tool results), sampling params (tool choice and output format as one constraint), the chat template's
options, and the tool parser that reads calls out of the output. Shared by HTTP chat and the WebSocket."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmserve.api import convert
from mmserve.api.app import ServerState
from mmserve.api.protocol import ChatFields, ChatMessage
from mmserve.errors import InvalidRequestError
from mmserve.request import SamplingParams

if TYPE_CHECKING:
    from mmserve.api.tool_parsers import ToolParser

# Options chat_prompt() takes itself: chat_template_kwargs may not set them.
_TEMPLATE_OPTIONS = ("tools", "add_generation_prompt", "continue_final_message", "chat_template")


@dataclass
class PreparedChat:
    messages: list[dict[str, Any]]
    params: SamplingParams
    template: dict[str, Any]  # chat_prompt()'s keyword options
    counts: dict[str, int]  # media items per kind (metrics)
    tools: list[dict[str, Any]] | None = None  # the tools offered, as the parser reads them
    tool_parser: ToolParser | None = None  # set when the output is to be read for tool calls
    extra: dict[str, Any] = field(default_factory=dict)


def template_options(state: ServerState, body: Any, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The chat template's options of a chat (or tokenize) request; a 400 for contradicting ones."""
    if body.continue_final_message and body.add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message: cannot be true together with add_generation_prompt (set it to false to "
            "continue the final assistant message)",
            param="continue_final_message",
        )
    kwargs = dict(body.chat_template_kwargs or {})
    clash = [k for k in kwargs if k in _TEMPLATE_OPTIONS or k in ("messages", "tokenize", "conversation")]
    if clash:
        raise InvalidRequestError(
            f"chat_template_kwargs: {clash[0]!r} cannot be set here (it is a request field of its own)",
            param=f"chat_template_kwargs.{clash[0]}",
        )
    return {
        "tools": tools,
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
        "chat_template": body.chat_template or state.settings.chat_template,
        "chat_template_kwargs": kwargs or None,
    }


def with_tool_fields(engine_messages: list[dict[str, Any]], wire: list[ChatMessage]) -> list[dict[str, Any]]:
    """Adds the tool fields of each wire message (tool calls of assistant turns, the call id of a tool result)
    to the resolved message. Arguments are handed to the template as objects (as vLLM does), since
    templates write them with `tojson`; text that is not JSON stays text."""
    for out, message in zip(engine_messages, wire, strict=True):
        if message.name is not None:
            out["name"] = message.name
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                try:
                    arguments: Any = json.loads(call.function.arguments)
                except ValueError:
                    arguments = call.function.arguments
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})  # fmt: skip
            out["tool_calls"] = calls
    return engine_messages


async def prepare_chat(state: ServerState, body: ChatFields) -> PreparedChat:
    """Raises InvalidRequestError / APIError (400s) for what cannot be served."""
    engine = state.engine
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice: Any = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    elif not isinstance(choice, str):
        choice = choice.model_dump()
    if tools is None and choice not in ("auto", "none"):
        raise InvalidRequestError("tool_choice: needs `tools`", param="tool_choice")
    use_tools = tools is not None and choice != "none"
    template = template_options(state, body, tools if use_tools else None)
    constraint, parser = None, None
    if use_tools:
        from mmserve.api.tool_parsers import default_tool_parser, get_tool_parser

        parser_name = state.settings.tool_call_parser or default_tool_parser(
            template["chat_template"] or getattr(engine.tokenizer, "chat_template", None)
        )
        parser = get_tool_parser(parser_name)
    if use_tools and choice != "auto":  # "required" or a named function: the output is a call
        assert tools is not None
        parallel = body.parallel_tool_calls if body.parallel_tool_calls is not None else True
        from mmserve.api.tool_parsers import tool_choice_constraint

        # The tokenizer's added tokens: Qwen's <tool_call> is one special token the grammar must name.
        added = tuple(engine.tokenizer.get_added_vocab())
        constraint = tool_choice_constraint(tools, choice, parser_name, parallel, added_tokens=added)
        if convert.structured_outputs(body) is not None:
            raise InvalidRequestError(
                "tool_choice: a required or named tool choice cannot be combined with another output "
                "constraint (response_format, structured_outputs)",
                param="tool_choice",
            )
    messages, counts = await state.resolver.resolve(body.messages)
    messages = with_tool_fields(messages, body.messages)
    params = convert.sampling_params(
        body, engine.max_model_len, state.generation_defaults, structured=constraint
    )
    convert.check_kv_transfer(params, bool(getattr(body, "stream", False)))
    return PreparedChat(messages, params, template, counts, tools if use_tools else None, parser)
