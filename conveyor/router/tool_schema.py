"""OpenAI tool calling, the request side: the tool definitions a request carries, their checks, the system section
that describes them to a chat template without tool support (SmolLM2's ChatML among them; marked, so a template
without a system role takes it in the first user turn: serving/detokenizer.py), and the JSON schemas
that enforce tool_choice "required" or a named function. The model's calls are read back by router/tool_calls.py.
"""
from __future__ import annotations

import collections
import copy
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from conveyor.router import json_limits
from conveyor.serving.detokenizer import TOOLS_SECTION_KEY

_NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Lenient(BaseModel):
    # Unknown fields are ignored, as most OpenAI-compatible servers do: clients (LangChain, the openai SDK's
    # extra_body) send parameters we do not implement, and OpenAI adds some over time; refusing them breaks those
    # clients outright.
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(Lenient):
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


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _CalledFunction(Lenient):
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, v: str) -> str:
        # Arguments that are not JSON are embedded as text (_call_block); JSON nested past the body's limit, or
        # holding a lone surrogate, is refused: rendering it would recurse, or fail in the tokenizer.
        try:
            json_limits.loads(v, what="tool call arguments")
        except json_limits.JsonLimitError:
            raise
        except ValueError:
            pass
        return v


class AssistantToolCall(Lenient):
    id: str
    type: Literal["function"] = "function"
    function: _CalledFunction


def check_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> None:
    """The cross-field checks pydantic cannot do per field; raises ValueError."""
    names = [t.function.name for t in tools or []]
    dupes = sorted(name for name, count in collections.Counter(names).items() if count > 1)  # linear
    if dupes:
        raise ValueError(f"duplicate tool names: {', '.join(dupes)}")
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if not names:
        raise ValueError("tool_choice 'required' or a named function needs at least one tool in 'tools'")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise ValueError(f"tool_choice names function {tool_choice.function.name!r}, which is not in 'tools'")


# ---- prompt rendering ---------------------------------------------------------------------------------
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
            # marked: a chat template without a system role gets it in the first user turn (detokenizer.py)
            out.insert(0, {"role": "system", "content": section, TOOLS_SECTION_KEY: "1"})
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


def forced_call_schema(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool) -> dict[str, Any] | None:
    """The JSON schema a forced tool call is constrained to; None when the model answers freely."""
    if not tools or choice is None or choice in ("none", "auto"):
        return None
    if choice == "required":
        return required_schema(tools, parallel)
    return named_schema(next(t for t in tools if t.function.name == choice.function.name))


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
