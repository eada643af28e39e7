"""Tool calls in generated text: the hermes and qwen3_xml parsers (whole text and streamed) and the Lark grammar
that forces a call for tool_choice "required" or a named function.

Knows text, OpenAI tool dicts and their JSON schemas; never HTTP, tokens or the engine.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from mmserve.errors import InvalidRequestError
from mmserve.request import StructuredOutputs

TOOL_PARSERS: tuple[str, ...] = ("hermes", "qwen3_xml")

_START = "<tool_call>"
_END = "</tool_call>"
_FUNCTION = "<function="
_FUNCTION_END = "</function>"
_PARAMETER = "<parameter="
_PARAMETER_END = "</parameter>"
_NL = "\n"


@dataclass(frozen=True)
class ToolCall:
    id: str  # "call_" + 24 random hex chars, made by the parser
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None  # text outside the tool calls; None if only whitespace
    tool_calls: list[ToolCall]  # [] when the output holds no (well-formed) call


@dataclass(frozen=True)
class ToolCallDelta:
    """One OpenAI streaming fragment of choices[].delta.tool_calls[]."""

    index: int  # which call of the message
    id: str | None  # set (with name) on the call's first fragment only
    name: str | None
    arguments: str  # an argument-text fragment ("" on a first fragment that carries no argument text yet)


@dataclass(frozen=True)
class StreamDelta:
    content: str | None
    tool_calls: list[ToolCallDelta]


class ToolCallStream(Protocol):
    def feed(self, new_text: str) -> StreamDelta: ...  # the next piece of generated text

    def finish(self) -> StreamDelta: ...  # end of output: flush what is held back


class ToolParser(Protocol):
    name: str

    def parse(self, text: str, *, tools: list[dict] | None = None) -> ParsedMessage: ...

    def stream(self, *, tools: list[dict] | None = None) -> ToolCallStream: ...


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest proper prefix of `token` that `text` ends with (what must be held back)."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def _json_escape(text: str) -> str:
    """The inside of a JSON string literal; per character, so escaping pieces equals escaping the whole."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class _Stream:
    """The text/call state machine both formats share; subclasses parse a call's body (`_call_step`).

    Content rules: text outside calls streams at once except (a) a suffix that may start `<tool_call>` and (b)
    trailing whitespace, which waits for the next non-whitespace text: whitespace next to a call is dropped and
    whitespace-only output is never sent. Concatenated content therefore equals `parse(...).content`."""

    def __init__(self, tools: list[dict] | None) -> None:
        self._tools = _functions_by_name(tools)
        self._buf = ""  # received, not yet consumed
        self._in_call = False
        self._raw = False  # inside a malformed call that is passed on as content until </tool_call>
        self._after_call = False  # drop whitespace that follows a call
        self._ws_hold = ""  # trailing whitespace of the content, not yet sent
        self._ws_before_call = ""
        self._said_content = False
        self._index = -1  # index of the current (last) call
        self._finished = False
        # Some call was not well-formed: parse() then returns the whole text as content.
        self.malformed = False
        self._content: list[str] = []
        # Content that followed a call fragment within this delta: sent first in the next one, to keep the order.
        self._deferred: list[str] = []
        self._calls: list[ToolCallDelta] = []

    # ---- public
    def feed(self, new_text: str) -> StreamDelta:
        if self._finished:  # nothing follows finish(); ignored rather than raised
            return StreamDelta(None, [])
        self._buf += new_text
        self._run(final=False)
        return self._take()

    def finish(self) -> StreamDelta:
        if self._finished:
            return StreamDelta(None, [])
        self._run(final=True)
        self._finished = True
        self._content += self._deferred
        self._deferred = []
        return self._take()

    # ---- emission
    def _take(self) -> StreamDelta:
        content = "".join(self._content) or None
        merged: list[ToolCallDelta] = []
        for d in self._calls:
            if merged and merged[-1].index == d.index and d.id is None:
                last = merged[-1]
                merged[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + d.arguments)
            else:
                merged.append(d)
        self._content, self._calls = self._deferred, []
        self._deferred = []
        return StreamDelta(content, merged)

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._ws_hold + text
        body = text.rstrip()
        self._ws_hold = text[len(body) :]
        if body:
            (self._deferred if self._calls else self._content).append(body)
            self._said_content = True

    def _begin_call(self, name: str) -> None:
        self._index += 1
        self._calls.append(ToolCallDelta(self._index, new_call_id(), name, ""))

    def _args(self, fragment: str) -> None:
        if fragment:
            self._calls.append(ToolCallDelta(self._index, None, None, fragment))

    def _end_call(self) -> None:
        self._in_call = False
        self._after_call = True

    def _go_raw(self, body: str) -> None:
        """A call that is malformed before its name: its text so far, and until </tool_call>, is content."""
        self.malformed = True
        self._raw = True
        self._buf = body
        self._ws_hold = self._ws_before_call
        self._text(_START)

    # ---- driver
    def _run(self, final: bool) -> None:
        while True:
            if self._raw:
                i = self._buf.find(_END)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self._buf, _END)
                    self._text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    if not final:
                        return
                    self._raw = self._in_call = False
                    self._flush_ws()
                    return
                self._text(self._buf[: i + len(_END)])
                self._buf = self._buf[i + len(_END) :]
                self._raw = self._in_call = False
                continue
            if not self._in_call:
                i = self._buf.find(_START)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self._buf, _START)
                    self._text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    if final:
                        self._flush_ws()
                    return
                self._text(self._buf[:i])
                # Whitespace before a call is dropped (kept aside in case the call turns out to be text).
                self._ws_before_call, self._ws_hold = self._ws_hold, ""
                self._buf = self._buf[i + len(_START) :]
                self._in_call = True
                self._start_body()
            self._call_step(final)
            if self._in_call and not self._raw:
                return  # needs more text

    def _flush_ws(self) -> None:
        if self._said_content and self._ws_hold:
            (self._deferred if self._calls else self._content).append(self._ws_hold)
        self._ws_hold = ""

    def _skip_to_end(self, final: bool) -> None:
        """After a call's body: drop text up to and including </tool_call> (or the end)."""
        i = self._buf.find(_END)
        if i >= 0:
            self._buf = self._buf[i + len(_END) :]
            self._end_call()
        elif final:
            self._buf = ""
            self._end_call()
        else:
            self._buf = self._buf[len(self._buf) - _partial_suffix(self._buf, _END) :]

    # ---- format hooks
    def _start_body(self) -> None:
        raise NotImplementedError

    def _call_step(self, final: bool) -> None:
        """Consume from self._buf; end the call (self._in_call False or self._raw True) or wait for more text.
        With final=True it must end the call."""
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------------ hermes

_JSON_STRING = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
# The form Qwen's templates write: {"name": "...", "arguments": {...}}; the arguments object starts at the match end.
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*(' + _JSON_STRING + r')\s*,\s*"arguments"\s*:\s*(?=\{)')


def _hermes_fallback(body: str) -> tuple[str, str] | None:
    """A call body in another key order or form: name and re-serialized arguments, or None if malformed."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class _HermesStream(_Stream):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

    Canonical order (name, then arguments): id+name as soon as the arguments' `{` arrives, then the argument text
    verbatim as it comes (tracked by bracket depth outside strings). Any other body is held until </tool_call> and
    sent whole (arguments re-serialized), or as content if it is not a JSON call object."""

    def _start_body(self) -> None:
        self._state = "head"
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._args_text: list[str] = []

    def _call_step(self, final: bool) -> None:
        if self._state == "head":
            self._head(final)
        if self._in_call and self._state == "args":
            self._scan_args(final)
        if self._in_call and self._state == "trailer":
            self._skip_to_end(final)

    def _head(self, final: bool) -> None:
        buf = self._buf
        stripped = buf.lstrip()
        if stripped and stripped[0] != "{":
            self._go_raw(buf)  # not a JSON object: cannot be a call
            return
        close = buf.find(_END)
        region = buf if close < 0 else buf[:close]
        m = _HERMES_HEAD.match(region)
        if m:
            self._begin_call(json.loads(m.group(1)))
            self._buf = buf[m.end() :]
            self._state = "args"
            return
        if close < 0 and not final:
            return
        parsed = _hermes_fallback(region)
        if parsed is None:
            self.malformed = True
            self._in_call = False
            self._ws_hold = self._ws_before_call
            self._text(_START + region + (_END if close >= 0 else ""))
            self._buf = buf[close + len(_END) :] if close >= 0 else ""
            return
        self._begin_call(parsed[0])
        self._args(parsed[1])
        self._buf = buf[close + len(_END) :] if close >= 0 else ""
        self._end_call()

    def _scan_args(self, final: bool) -> None:
        buf = self._buf
        i, closed, broken = 0, False, False
        while i < len(buf):
            c = buf[i]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    i += 1
                    closed = True
                    break
            elif c == "<":
                # Never valid JSON outside a string: most likely </tool_call> after broken arguments.
                broken = True
                break
            i += 1
        self._args(buf[:i])
        self._args_text.append(buf[:i])
        self._buf = buf[i:]
        if closed:
            try:
                ok = isinstance(json.loads("".join(self._args_text)), dict)
            except ValueError:
                ok = False
            self.malformed |= not ok
            self._state = "trailer"
        elif broken or final:
            self.malformed = True
            self._state = "trailer"


class HermesToolParser:
    """Qwen2.5 / Qwen3 / Qwen3-VL: JSON calls in <tool_call> blocks (the name comes from the hermes models)."""

    name = "hermes"

    def parse(self, text: str, *, tools: list[dict] | None = None) -> ParsedMessage:
        return _parse_with(self.stream(tools=tools), text)

    def stream(self, *, tools: list[dict] | None = None) -> _HermesStream:
        return _HermesStream(tools)


# --------------------------------------------------------------------------------------------------- qwen3_xml


def _param_kind(schema: dict | None) -> str:
    """How a qwen3_xml parameter value reads: "string" (raw text), "boolean", "json" (JSON text) or "unknown"."""
    if not isinstance(schema, dict):
        return "unknown"
    t = schema.get("type")
    if t == "string":
        return "string"
    if t is None:
        values = schema["enum"] if isinstance(schema.get("enum"), list) else None
        if "const" in schema:
            values = [schema["const"]]
        if values and all(isinstance(v, str) for v in values):
            return "string"
        return "unknown"
    if t == "boolean":
        return "boolean"
    if t in ("integer", "number", "object", "array", "null"):
        return "json"
    return "unknown"


def _convert_value(raw: str, kind: str) -> object:
    """A raw parameter value as the JSON value it stands for; text that does not read as its type stays text."""
    if kind == "string":
        return raw
    if kind == "boolean":
        low = raw.strip().lower()
        return low == "true" if low in ("true", "false") else raw
    try:
        return json.loads(raw.strip())
    except ValueError:
        return raw


class _Qwen3XmlStream(_Stream):
    """`<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`.

    Arguments are built as `{"P": value, ...}`: a string-typed parameter (by the tool's schema) streams as its
    value arrives; any other value is sent when its </parameter> is seen, converted by the schema's type."""

    def _start_body(self) -> None:
        self._state = "head"
        self._fn_name = ""
        self._count = 0  # parameters written
        self._opened = False  # "{" sent
        self._pname = ""
        self._kind = "unknown"
        self._value_started = False

    def _call_step(self, final: bool) -> None:
        while self._in_call and not self._raw:
            before = (self._state, len(self._buf))
            if self._state == "head":
                self._head(final)
            elif self._state == "params":
                self._params(final)
            elif self._state == "value":
                self._value(final)
            else:
                self._skip_to_end(final)
            if (self._state, len(self._buf)) == before and self._in_call and not self._raw:
                return  # needs more text

    def _head(self, final: bool) -> None:
        s = self._buf.lstrip()
        if not s:
            if final:
                self._go_raw(self._buf)
            return
        if not s.startswith(_FUNCTION):
            if _FUNCTION.startswith(s) and not final:
                return
            self._go_raw(self._buf)
            return
        j = s.find(">", len(_FUNCTION))
        rest = s[len(_FUNCTION) : j if j >= 0 else len(s)]
        if "\n" in rest or "<" in rest or (j >= 0 and not rest.strip()) or (j < 0 and final):
            self._go_raw(self._buf)
            return
        if j < 0:
            return
        self._fn_name = rest.strip()
        self._begin_call(self._fn_name)
        self._buf = s[j + 1 :]
        self._state = "params"

    def _close_args(self) -> None:
        self._args("}" if self._opened else "{}")

    def _bad(self) -> None:
        """Malformed after the name was sent: close the arguments object and drop up to </tool_call>."""
        self.malformed = True
        if self._state == "value" and self._kind == "string" and self._value_started:
            self._args('"')
        self._close_args()
        self._state = "skip"

    def _key(self) -> str:
        prefix = ", " if self._opened else "{"
        self._opened = True
        return prefix + json.dumps(self._pname, ensure_ascii=False) + ": "

    def _params(self, final: bool) -> None:
        s = self._buf.lstrip()
        if s.startswith(_PARAMETER):
            j = s.find(">", len(_PARAMETER))
            rest = s[len(_PARAMETER) : j if j >= 0 else len(s)]
            if "\n" in rest or "<" in rest or (j >= 0 and not rest.strip()) or (j < 0 and final):
                self._bad()
                return
            if j < 0:
                self._buf = s
                return
            self._pname = rest.strip()
            self._kind = _param_kind(self._param_schema(self._pname))
            self._value_started = False
            self._buf = s[j + 1 :]
            self._state = "value"
        elif s.startswith(_FUNCTION_END):
            self._close_args()
            self._buf = s[len(_FUNCTION_END) :]
            self._state = "skip"
        elif not final and (_PARAMETER.startswith(s) or _FUNCTION_END.startswith(s)):
            self._buf = s
        else:
            self._bad()

    def _value(self, final: bool) -> None:
        if not self._value_started:
            if not self._buf:
                if final:
                    self._bad()
                return
            if self._buf[0] == "\n":
                self._buf = self._buf[1:]
            self._value_started = True
            if self._kind == "string":
                self._args(self._key() + '"')
        buf = self._buf
        k = buf.find(_PARAMETER_END)
        if k >= 0:
            raw = buf[:k]
            raw = raw[:-1] if raw.endswith("\n") else raw
            if self._kind == "string":
                self._args(_json_escape(raw) + '"')
            else:
                value = _convert_value(raw, self._kind)
                self._args(self._key() + json.dumps(value, ensure_ascii=False))
            self._count += 1
            self._buf = buf[k + len(_PARAMETER_END) :]
            self._state = "params"
            return
        if final:
            self._bad()
            return
        if self._kind == "string":
            hold = _partial_suffix(buf, _PARAMETER_END)
            if len(buf) > hold and buf[len(buf) - hold - 1] == "\n":
                hold += 1  # may be the newline before </parameter>, which is not part of the value
            self._args(_json_escape(buf[: len(buf) - hold]))
            self._buf = buf[len(buf) - hold :]

    def _param_schema(self, pname: str) -> dict | None:
        fn = self._tools.get(self._fn_name)
        params = fn.get("parameters") if fn else None
        props = params.get("properties") if isinstance(params, dict) else None
        schema = props.get(pname) if isinstance(props, dict) else None
        return schema if isinstance(schema, dict) else None


class Qwen3XmlToolParser:
    """Qwen3-Coder: <function=NAME> with one <parameter=P> block per argument inside <tool_call>."""

    name = "qwen3_xml"

    def parse(self, text: str, *, tools: list[dict] | None = None) -> ParsedMessage:
        return _parse_with(self.stream(tools=tools), text)

    def stream(self, *, tools: list[dict] | None = None) -> _Qwen3XmlStream:
        return _Qwen3XmlStream(tools)


# ---------------------------------------------------------------------------------------------------- shared


def _functions_by_name(tools: list[dict] | None) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn
    return out


def _parse_with(stream: _Stream, text: str) -> ParsedMessage:
    """The whole text through the streaming machine (so both agree); any malformed call: all of it is content."""
    deltas = [stream.feed(text), stream.finish()]
    if stream.malformed:
        return ParsedMessage(text if text.strip() else None, [])
    content = "".join(d.content or "" for d in deltas)
    calls: list[list[str]] = []  # [id, name, arguments]
    for d in deltas:
        for c in d.tool_calls:
            if c.id is not None:
                calls.append([c.id, c.name or "", c.arguments])
            else:
                calls[c.index][2] += c.arguments
    return ParsedMessage(content or None, [ToolCall(i, n, a) for i, n, a in calls])


_PARSERS: dict[str, Callable[[], ToolParser]] = {"hermes": HermesToolParser, "qwen3_xml": Qwen3XmlToolParser}


def get_tool_parser(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; valid: {', '.join(TOOL_PARSERS)}")
    return _PARSERS[name]()


def default_tool_parser(chat_template: str | None) -> str:
    """Returns "qwen3_xml" when the template writes Qwen3-Coder's `<function=...>` / `<parameter=...>` calls, else "hermes"."""
    if chat_template and "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_xml"
    return "hermes"


# ------------------------------------------------------------------------------------------------- grammars

# JSON inside the grammar: the spacing Qwen's templates write (", " and ": ", a space optional), no other
# whitespace; keywords llguidance does not implement are ignored rather than failing the request.
_JSON_OPTIONS = {
    "whitespace_flexible": False,
    "item_separator": ", ?",
    "key_separator": ": ?",
    "lenient": True,
}


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: dict) -> str:
    schema = dict(schema)
    schema["x-guidance"] = {**_JSON_OPTIONS, **(schema.get("x-guidance") or {})}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _allowed_functions(tools: list[dict], tool_choice: str | dict) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError(
            "tools: must be a non-empty list when tool_choice forces a call", param="tools"
        )
    fns: list[dict] = []
    for i, tool in enumerate(tools):
        fn = (
            tool.get("function")
            if isinstance(tool, dict) and tool.get("type", "function") == "function"
            else None
        )
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError(
                f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ...}}}}",
                param=f"tools[{i}]",
            )
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError(
                f"tools[{i}].function.parameters: must be a JSON schema object",
                param=f"tools[{i}].function.parameters",
            )
        fns.append(fn)
    if tool_choice == "required":
        return fns
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        chosen = [fn for fn in fns if fn["name"] == name]
        if not chosen:
            raise InvalidRequestError(
                f"tool_choice: function {name!r} is not among the tools ({', '.join(fn['name'] for fn in fns)})",
                param="tool_choice",
            )
        return chosen[:1]
    raise InvalidRequestError(
        "tool_choice: only 'required' or {'type': 'function', 'function': {'name': ...}} is enforced by a grammar, "
        f"got {tool_choice!r}",
        param="tool_choice",
    )


def _parameters(fn: dict) -> dict:
    # OpenAI: omitted parameters means a function that takes none.
    params = fn.get("parameters")
    return (
        params if params is not None else {"type": "object", "properties": {}, "additionalProperties": False}
    )


def _hermes_rules(i: int, fn: dict) -> list[str]:
    head = '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '
    return [f"fn_{i}: {_lit(head)} args_{i} {_lit('}')}", f"args_{i}: {_json_rule(_parameters(fn))}"]


def _xml_value_rules(i: int, j: int, schema: dict | None) -> tuple[str, list[str]]:
    """(what follows `<parameter=P>\\n`, through `\\n</parameter>\\n`; extra rules) for one parameter."""
    kind = _param_kind(schema)
    end = _lit("\n" + _PARAMETER_END + "\n")
    if kind == "string" and isinstance(schema, dict):
        values = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(values, list) and values:
            if any(_PARAMETER_END in v for v in values):
                raise InvalidRequestError("tools: a string enum value holds </parameter>", param="tools")
            return "(" + " | ".join(_lit(v) for v in values) + ") " + end, []
        lo = schema.get("minLength", 0)
        hi = schema.get("maxLength")
        lo = lo if isinstance(lo, int) and lo >= 0 else 0
        hi = hi if isinstance(hi, int) and hi >= lo else None
        reps = f"{{{lo},{hi}}}" if hi is not None else f"{{{lo},}}"
        # The value ends at the first </parameter> (as parse reads it), so it cannot hold one.
        term = f"PV_{i}_{j}"
        rules = [
            f"v_{i}_{j}[lazy]: {term}",
            f"{term}: (/(?s:.){reps}/ & ~/(?s:.)*<\\/parameter>(?s:.)*/) {_lit(_NL + _PARAMETER_END)}",
        ]
        return f"v_{i}_{j} {_lit(_NL)}", rules
    if kind == "boolean":
        return '("true" | "false" | "True" | "False") ' + end, []
    return f"{_json_rule(schema if isinstance(schema, dict) else {})} {end}", []


def _xml_rules(i: int, fn: dict) -> list[str]:
    params = _parameters(fn)
    props = params.get("properties")
    required = params.get("required") if isinstance(params.get("required"), list) else []
    rules: list[str] = []
    parts: list[str] = []
    if isinstance(props, dict) and props:
        for j, (pname, schema) in enumerate(props.items()):
            if not pname or any(c in pname for c in "<>\n"):
                raise InvalidRequestError(
                    f"tools: parameter name {pname!r} cannot be written in the qwen3_xml form", param="tools"
                )
            schema = schema if isinstance(schema, dict) else None
            if schema is not None and "$ref" in json.dumps(schema):
                # Refs point into the parameters schema: give the parameter's own schema its definitions.
                schema = {**{k: params[k] for k in ("$defs", "definitions") if k in params}, **schema}
            body, extra = _xml_value_rules(i, j, schema)
            rules.append(f"p_{i}_{j}: {_lit(_PARAMETER + pname + '>' + _NL)} {body}")
            rules += extra
            parts.append(f"p_{i}_{j}" + ("" if pname in required else "?"))
    elif not isinstance(props, dict) and params.get("additionalProperties", True) is not False:
        # A free-form object: any parameters, values read as JSON where they parse, else as text.
        rules += [
            f"p_{i}_any: {_lit(_PARAMETER)} /[A-Za-z0-9_.\\-]+/ {_lit('>' + _NL)} v_{i}_any {_lit(_NL)}",
            f"v_{i}_any[lazy]: PV_{i}_ANY",
            f"PV_{i}_ANY: (/(?s:.)*/ & ~/(?s:.)*<\\/parameter>(?s:.)*/) {_lit(_NL + _PARAMETER_END)}",
        ]
        parts.append(f"p_{i}_any*")
    head = _lit(_FUNCTION + fn["name"] + ">\n")
    rules.insert(0, f"fn_{i}: {head} {' '.join(parts)} {_lit(_FUNCTION_END + _NL)}")
    return rules


def tool_choice_constraint(
    tools: list[dict],
    tool_choice: str | dict,
    parser: str,
    parallel_tool_calls: bool,
    *,
    added_tokens: Collection[str] = (),
) -> StructuredOutputs:
    """A Lark grammar (llguidance) that forces the output to be one call (one or more with parallel_tool_calls)
    in `parser`'s format, of the allowed tool(s), its arguments held to the tool's JSON schema.

    `added_tokens`: the tokenizer's added tokens (e.g. `tokenizer.get_added_vocab()`). llguidance treats every
    added token as special, which a text literal does not match: where `<tool_call>` / `</tool_call>` are single
    tokens (Qwen2.5, Qwen3) the grammar allows those tokens as well as the spelled-out text. A name given here that
    the tokenizer lacks makes the grammar invalid for it.
    Raises InvalidRequestError for bad tools / tool_choice, ValueError for an unknown parser."""
    get_tool_parser(parser)
    fns = _allowed_functions(tools, tool_choice)
    if parser == "qwen3_xml" and any(any(c in fn["name"] for c in "<>\n") for fn in fns):
        raise InvalidRequestError("tools: a function name cannot hold '<', '>' or a newline", param="tools")
    rules: list[str] = []
    for i, fn in enumerate(fns):
        rules += _hermes_rules(i, fn) if parser == "hermes" else _xml_rules(i, fn)
    tags = [
        f"{rule}: {tag} | {_lit(tag)}" if tag in added_tokens else f"{rule}: {_lit(tag)}"
        for rule, tag in (("tag_open", _START), ("tag_close", _END))
    ]
    close = f"{_lit(_NL)} tag_close" if parser == "hermes" else "tag_close"
    lines = [
        'start: call ("\\n" call)*' if parallel_tool_calls else "start: call",
        f"call: tag_open {_lit(_NL)} fn {close}",
        *tags,
        "fn: " + " | ".join(f"fn_{i}" for i in range(len(fns))),
        *rules,
    ]
    # StructuredOutputs reads a grammar holding "::=" as GBNF: that can only sit inside JSON or Lark strings,
    # where \u003a is the same ':'.
    return StructuredOutputs(grammar="\n".join(lines).replace("::=", ":\\u003a=") + "\n")
