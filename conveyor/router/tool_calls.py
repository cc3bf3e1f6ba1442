"""OpenAI tool calling, the response side: the model's text turned into `message.tool_calls` and streamed deltas.

Calls are recognised Hermes / Qwen2.5 style: one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
block per call (tool_choice "auto"); under "required" or a named function the engine constrained the output to the
JSON schema of router/tool_schema.py: an array of {"name", "arguments"} objects, or the named function's arguments
object itself.

One streaming parser (ToolCallStreamer) serves both paths: the non-streaming parse_* functions feed it the whole
text, so a streamed response always reassembles into exactly what the non-streamed one would have returned.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any, Literal

from conveyor.router.tool_schema import CLOSE, OPEN


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
