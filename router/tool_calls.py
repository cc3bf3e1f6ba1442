"""OpenAI tool calling for chat templates without tool support (SmolLM2's ChatML among them).

Tools are described in a system section and calls are recognised in the model's text, Hermes / Qwen2.5 style:
one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` block per call. tool_choice "required" and a
named function are instead enforced with a JSON schema the engine constrains the output to: an array of
{"name", "arguments"} objects, or the named function's arguments object itself.

One streaming parser (ToolCallStreamer) serves both paths: the non-streaming parse_* functions feed it the whole
text, so a streamed response always reassembles into exactly what the non-streamed one would have returned.
"""
from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"


class _Lenient(BaseModel):
    # Clients send fields we do not use (OpenAI adds some over time): ignore them rather than refuse the request.
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):
            raise ValueError(f"function name {v!r} must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'")
        return v


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _CalledFunction(_Lenient):
    name: str
    arguments: str


class AssistantToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: _CalledFunction


def check_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> None:
    """The cross-field checks pydantic cannot do per field; raises ValueError."""
    names = [t.function.name for t in tools or []]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"duplicate tool names: {', '.join(dupes)}")
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if not names:
        raise ValueError("tool_choice 'required' or a named function needs at least one tool in 'tools'")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise ValueError(f"tool_choice names function {tool_choice.function.name!r}, which is not in 'tools'")


# ---- prompt rendering ---------------------------------------------------------------------------------
def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders tools itself (then the caller passes tools to it, not render_messages)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def _text(content: Any) -> str:
    if isinstance(content, list):  # text parts
        return "".join(p.get("text", "") for p in content)
    return content or ""


def _tools_section(tools: list[Tool], tool_choice: ToolChoice | None) -> str:
    listing = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    section = (
        "# Tools\n\nYou are a function-calling AI assistant. You may call one or more functions to assist with "
        f"the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{listing}\n</tools>\n\nTo call a function, answer with a JSON object with the function name and its "
        "arguments within <tool_call></tool_call> XML tags, one block per call:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    # The output is constrained anyway; saying so keeps the model's intent in line with what it is forced to write.
    if tool_choice == "required":
        section += "\n\nYou must call at least one function."
    elif isinstance(tool_choice, NamedToolChoice):
        section += f"\n\nYou must call the function {tool_choice.function.name}."
    return section


def _call_block(call: AssistantToolCall) -> str:
    try:  # arguments are a JSON string in OpenAI's API; embed the object as the model is asked to write it
        args: Any = json.loads(call.function.arguments)
    except ValueError:
        args = call.function.arguments
    body = json.dumps({"name": call.function.name, "arguments": args}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def render_messages(
    messages: list[dict[str, Any]], tools: list[Tool] | None, tool_choice: ToolChoice | None
) -> list[dict[str, str]]:
    """OpenAI chat messages (with tool calls and tool results) as plain role/content messages for ChatML."""
    out: list[dict[str, str]] = []
    prev_role = None
    for m in messages:
        role, text = m["role"], _text(m.get("content"))
        if role == "assistant" and m.get("tool_calls"):
            blocks = [_call_block(AssistantToolCall.model_validate(c)) for c in m["tool_calls"]]
            text = "\n".join(([text] if text else []) + blocks)
        if role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        if role == "tool" and prev_role == "tool":  # consecutive results are one user turn, as Qwen2.5 renders
            out[-1]["content"] += "\n" + text
        else:
            out.append({"role": "user" if role == "tool" else role, "content": text})
        prev_role = role
    if tools and tool_choice != "none":
        section = _tools_section(tools, tool_choice)
        if out and out[0]["role"] in ("system", "developer"):
            # Qwen2.5's order: the caller's system prompt first, then the tools section
            out[0]["content"] = f"{out[0]['content']}\n\n{section}" if out[0]["content"] else section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


# ---- constraint schemas -------------------------------------------------------------------------------
def _rewrite_refs(node: Any, name: str) -> Any:
    """Point a tool's local $refs at its copy under the root $defs (see required_schema)."""
    if isinstance(node, list):
        return [_rewrite_refs(v, name) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rewrite_refs(v, name) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str):
        m = re.fullmatch(r"#/(?:\$defs|definitions)/(.*)", ref)
        if m:
            out["$ref"] = f"#/$defs/{name}.{m.group(1)}"
        elif ref == "#" or ref.startswith("#/"):
            out["$ref"] = f"#/$defs/{name}{ref[1:]}"
        else:
            raise ValueError(f"tool {name!r}: only local $refs ('#...') are supported, got {ref!r}")
    return out


def _arguments_schema(tool: Tool, defs: dict[str, Any]) -> dict[str, Any]:
    # Tool names cannot contain '.', so "<name>" (the parameters schema) and "<name>.<def>" never collide
    # across tools. Refs into the root ("#", "#/properties/...") go to the hoisted copy of the whole schema.
    name, params = tool.function.name, copy.deepcopy(tool.function.parameters)
    if '"$ref"' not in json.dumps(params):  # nothing to resolve: inline the schema as it is
        return params
    for key in ("$defs", "definitions"):
        for def_name, sub in params.pop(key, {}).items():
            defs[f"{name}.{def_name}"] = _rewrite_refs(sub, name)
    for key in ("$id", "$schema"):  # an $id would change the base the rewritten refs resolve against
        params.pop(key, None)
    defs[name] = _rewrite_refs(params, name)
    return {"$ref": f"#/$defs/{name}"}


def required_schema(tools: list[Tool], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """Schema of tool_choice "required" output: a JSON array of {"name", "arguments"} calls, at least one."""
    defs: dict[str, Any] = {}
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": _arguments_schema(t, defs)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": variants}, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tool: Tool) -> dict[str, Any]:
    """Schema of a named tool_choice's output: the arguments object itself (its $defs stay at the root)."""
    return copy.deepcopy(tool.function.parameters)


# ---- parsing ------------------------------------------------------------------------------------------
def _start(index: int, name: str) -> dict[str, Any]:
    call = {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
    return {"tool_calls": [{**call, "function": {"name": name, "arguments": ""}}]}


def _args(index: int, fragment: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":"))
    except ValueError:  # cut short (finish_reason "length"): hand back what the model wrote
        return text


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _block_call(body: str, tool_names: set[str]) -> tuple[str, str] | None:
    """(name, compact arguments) of a <tool_call> block's body, or None when it is not a call to a known tool."""
    obj = _loads(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))  # some models write "parameters"
    args = _loads(args) if isinstance(args, str) else args  # and some the arguments JSON as a string
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":"))


class ToolCallStreamer:
    """Turns model output text, delta by delta, into OpenAI chat delta dicts (content and tool_calls)."""

    def __init__(self, mode: Literal["required", "named", "auto"], tool_names: Iterable[str] = (),
                 named: str | None = None) -> None:
        self.mode, self.tool_names, self.named = mode, set(tool_names), named
        self.calls = 0  # tool calls started; also the next call's index
        self._buf = ""  # auto: text not yet emitted
        self._in_block = self._started = False
        self._ws = ""  # whitespace held back: trailing content (auto) or after a value (required)
        # required: JSON nesting of the array, and the current call object's member being read
        self._depth, self._in_str, self._esc = 0, False, False
        self._key: str | None = None
        self._member = self._pending = ""
        self._name: str | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.mode == "named":
            text = self._trim(text)  # whitespace around the value is no part of the arguments
            out = [] if self.calls or not text else [_start(0, self.named or "")]
            self.calls = max(self.calls, len(out))
            return out + ([_args(0, text)] if text else [])
        if self.mode == "required":
            return [d for c in text for d in self._scan(c)]
        self._buf += text
        return self._auto()

    def finish(self) -> list[dict[str, Any]]:
        if self.mode == "named":
            out = [] if self.calls else [_start(0, self.named or "")]  # no output at all: still the forced call
            self.calls = 1
            return out
        if self.mode == "required":
            return self._end_member() if self._key == "name" else []
        out = self._block(self._buf, OPEN + self._buf) if self._in_block else self._content(self._buf)
        self._buf = ""
        return out

    # auto: content around <tool_call> blocks
    def _auto(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            tag = CLOSE if self._in_block else OPEN
            i = self._buf.find(tag)
            if i < 0 and self._in_block:
                return out  # a block is emitted whole, once it ends
            if i < 0:  # hold back a suffix that may be the start of <tool_call>
                keep = next((k for k in range(len(OPEN) - 1, 0, -1) if self._buf.endswith(OPEN[:k])), 0)
                out += self._content(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            head, self._buf = self._buf[:i], self._buf[i + len(tag):]
            out += self._block(head, OPEN + head + CLOSE) if self._in_block else self._content(head)
            self._in_block = not self._in_block

    def _block(self, body: str, raw: str) -> list[dict[str, Any]]:
        call = _block_call(body, self.tool_names)
        if call is None:  # not a call we can honour: the client sees the text as the model wrote it
            return self._content(raw)
        self.calls += 1
        return [_start(self.calls - 1, call[0]), _args(self.calls - 1, call[1])]

    def _content(self, text: str) -> list[dict[str, Any]]:
        body = self._trim(text)
        return [{"content": body}] if body else []

    def _trim(self, text: str) -> str:
        """The part of text to send now, stripping the whole stream: leading whitespace is dropped and trailing
        whitespace held until more text follows it. The openai SDK's partial JSON parse of a strict tool's
        arguments fails on leading whitespace, and parse_auto returns content stripped."""
        if not self._started:
            text = text.lstrip()
        text, self._started = self._ws + text, self._started or bool(text)
        body = text.rstrip()
        self._ws = text[len(body):]
        return body

    # required: an incremental scan of [{"name": ..., "arguments": {...}}, ...]
    def _scan(self, c: str) -> list[dict[str, Any]]:
        depth, in_str = self._depth, self._in_str
        if in_str:
            self._in_str = self._esc or c != '"'
            self._esc = not self._esc and c == "\\"
        elif c == '"':
            self._in_str = True
        elif c in "[{":
            self._depth += 1
        elif c in "]}":
            self._depth -= 1
        if depth < 2:  # between calls: a new call object starts
            self._key, self._member, self._name, self._pending = None, "", None, ""
            return []
        if depth == 2 and not in_str and c in ",}":
            return self._end_member()
        if depth == 2 and not in_str and c == ":" and self._key is None:
            key = _loads(self._member)
            self._key, self._member = key if isinstance(key, str) else "", ""
            return []
        if self._key != "arguments":
            self._member += c
            return []
        if depth == 2 and not in_str and c.isspace():  # whitespace around the value is no part of it
            self._ws += c if self._member else ""
            return []
        fragment, self._ws = self._ws + c, ""
        self._member += fragment
        if self._name is None:
            self._pending += fragment
            return []
        return [_args(self.calls - 1, fragment)]

    def _end_member(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._key == "name" and self._name is None:
            self._name = _loads(self._member)
            if isinstance(self._name, str):  # the schema allows nothing else; a cut-short name is skipped
                self.calls += 1
                out.append(_start(self.calls - 1, self._name))
                out += [_args(self.calls - 1, self._pending)] if self._pending else []
        self._key, self._member, self._ws = None, "", ""
        return out


def _parse(streamer: ToolCallStreamer, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Feed the whole text and accumulate the deltas into (content, tool_calls) the way OpenAI clients do."""
    content, calls = "", []
    for d in streamer.feed(text) + streamer.finish():
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                calls.append({"id": tc["id"], "type": "function", "function": dict(tc["function"])})
            else:
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    for call in calls:
        call["function"]["arguments"] = _compact(call["function"]["arguments"])
    return content or None, calls


def parse_required(text: str) -> list[dict[str, Any]]:
    """Tool calls of tool_choice "required" output (a JSON array of {"name", "arguments"})."""
    return _parse(ToolCallStreamer("required"), text)[1]


def parse_named(name: str, text: str) -> list[dict[str, Any]]:
    """The one tool call of a named tool_choice: the output text is its arguments."""
    return _parse(ToolCallStreamer("named", named=name), text)[1]


def parse_auto(text: str, tool_names: Iterable[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of tool_choice "auto" output: <tool_call> blocks are calls, the rest content."""
    return _parse(ToolCallStreamer("auto", tool_names), text)


def finish_reason_for(num_calls: int, finish_reason: str = "stop") -> str:
    """"tool_calls" when the output made calls; a cut-short output stays "length" so clients can tell."""
    return "tool_calls" if num_calls and finish_reason != "length" else finish_reason
