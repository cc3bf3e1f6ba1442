"""router/tool_schema.py and router/tool_calls.py: request checks, prompt rendering, constraint schemas, parsing
and streaming."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from pydantic import TypeAdapter

from conveyor.router.tool_calls import (
    ToolCallStreamer,
    finish_reason_for,
    parse_auto,
    parse_named,
    parse_required,
)
from conveyor.router.tool_schema import (
    NamedToolChoice,
    Tool,
    ToolChoice,
    check_tools,
    named_schema,
    render_messages,
    required_schema,
)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}),
    Tool.model_validate({"type": "function", "function": {"name": "now", "description": "current time"}}),
]
NAMES = ["get_weather", "now"]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def _choice(value: object) -> ToolChoice:
    return TypeAdapter(ToolChoice).validate_python(value)


# ---- validation ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "function, message",
    [({"description": "x"}, "name"), ({"name": "has space"}, "1-64 characters"), ({"name": "x" * 65}, "1-64")],
)
def test_tool_validation_errors(function: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tool.model_validate({"type": "function", "function": function})


def test_tool_is_lenient_and_defaults_parameters() -> None:
    tool = Tool.model_validate({"type": "function", "function": {"name": "a-b_1", "x": 1}, "extra": 2})
    assert tool.function.parameters == {"type": "object", "properties": {}}
    with pytest.raises(ValueError):
        Tool.model_validate({"type": "retrieval", "function": {"name": "a"}})


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        (TOOLS + TOOLS[:1], "auto", "duplicate tool names: get_weather"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope', which is not in 'tools'"),
        (None, "required", "needs at least one tool"),
        ([], {"type": "function", "function": {"name": "now"}}, "needs at least one tool"),
    ],
)
def test_check_tools_errors(tools: list[Tool] | None, choice: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_tools(tools, _choice(choice))


def test_check_tools_accepts() -> None:
    for choice in ["none", "auto", "required", {"type": "function", "function": {"name": "now"}}]:
        check_tools(TOOLS, _choice(choice))
    check_tools(None, "none")
    check_tools(None, None)
    assert isinstance(_choice({"type": "function", "function": {"name": "now"}}), NamedToolChoice)
    with pytest.raises(ValueError):
        _choice("sometimes")


# ---- rendering ----------------------------------------------------------------------------------------
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris "}, {"type": "text", "text": "now?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "name": "now", "content": "noon"},
    {"role": "assistant", "content": "18C at noon."},
]


def test_render_conversation_with_tool_calls() -> None:
    out = render_messages(CONVERSATION, TOOLS, "auto")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools\n")
    assert "function-calling" in system
    tools_json = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in tools_json] == [t.model_dump(exclude_none=True) for t in TOOLS]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert out[1] == {"role": "user", "content": "Weather in Paris now?"}
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    assert out[3]["content"] == "<tool_response>\n18C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
    assert out[4] == {"role": "assistant", "content": "18C at noon."}
    assert all(set(m) == {"role", "content"} for m in out)


def test_render_system_section_placement() -> None:
    user = [{"role": "user", "content": "hi"}]
    out = render_messages(user, TOOLS, None)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools") and out[1:] == user
    assert render_messages(user, TOOLS, "none") == user
    assert render_messages(user, None, "auto") == user
    assert "You must call at least one function." in render_messages(user, TOOLS, "required")[0]["content"]
    named = render_messages(user, TOOLS, _choice({"type": "function", "function": {"name": "now"}}))
    assert named[0]["content"].endswith("You must call the function now.")
    # an assistant turn with text and a call keeps the text first; unparseable arguments stay a string
    msg = {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{oops"}}]}
    assert render_messages([msg], None, None)[0]["content"] == (
        'Sure.\n<tool_call>\n{"name": "now", "arguments": "{oops"}\n</tool_call>'
    )


def _valid(schema: dict, value: object) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_required_schema() -> None:
    schema = required_schema(TOOLS, parallel_tool_calls=True)
    good = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}, {"name": "now", "arguments": {}}]
    assert _valid(schema, good)
    assert not _valid(schema, [])
    assert not _valid(schema, [{"name": "get_time", "arguments": {}}])  # unknown name
    assert not _valid(schema, [{"name": "get_weather", "arguments": {"unit": "c"}}])  # arguments of that tool
    assert not _valid(schema, [{"name": "now", "arguments": {}, "why": 1}])
    assert not _valid(schema, [{"name": "now"}])
    single = required_schema(TOOLS, parallel_tool_calls=False)
    assert _valid(single, good[:1]) and not _valid(single, good)


def test_named_schema() -> None:
    schema = named_schema(TOOLS[0])
    assert _valid(schema, {"city": "Oslo"}) and not _valid(schema, {"town": "Oslo"})
    assert schema is not TOOLS[0].function.parameters


def _tool(name: str, parameters: dict) -> Tool:
    return Tool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})


def test_required_schema_hoists_defs() -> None:
    # Two tools with a def of the same name but different shapes, a "definitions" ref and a recursive root ref.
    a = _tool("a", {"type": "object", "$defs": {"Item": {"type": "integer"}},
                    "properties": {"x": {"$ref": "#/$defs/Item"}}, "required": ["x"]})
    b = _tool("b", {"type": "object", "definitions": {"Item": {"type": "string"}},
                    "properties": {"x": {"$ref": "#/definitions/Item"}, "child": {"$ref": "#"}}, "required": ["x"]})
    schema = required_schema([a, b])
    assert set(schema["$defs"]) == {"a", "a.Item", "b", "b.Item"}
    assert _valid(schema, [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"x": "s"}}])
    assert _valid(schema, [{"name": "b", "arguments": {"x": "s", "child": {"x": "t"}}}])
    assert not _valid(schema, [{"name": "a", "arguments": {"x": "s"}}])
    assert not _valid(schema, [{"name": "b", "arguments": {"x": 1}}])
    assert not _valid(schema, [{"name": "b", "arguments": {"x": "s", "child": {"x": 2}}}])
    assert _valid(named_schema(b), {"x": "s", "child": {"x": "t"}}) and not _valid(named_schema(a), {"x": "s"})
    with pytest.raises(ValueError, match="only local"):
        required_schema([_tool("c", {"properties": {"x": {"$ref": "https://example.com/s.json"}}})])


# ---- non-streaming parsing ----------------------------------------------------------------------------
def _simple(calls: list[dict]) -> list[tuple[str, object]]:
    for call in calls:
        assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parse_required_and_named() -> None:
    text = ' [ {"name" : "get_weather", "arguments" : {"city": "a}\\"{"}} ,\n{"name":"now","arguments":{ }} ] '
    calls = parse_required(text)
    assert _simple(calls) == [("get_weather", {"city": 'a}"{'}), ("now", {})]
    assert calls[0]["function"]["arguments"] == '{"city":"a}\\"{"}'  # compact
    assert _simple(parse_named("get_weather", ' {"city": "Oslo"}\n')) == [("get_weather", {"city": "Oslo"})]
    # arguments before the name (the schema fixes the order, but nothing here depends on it)
    swapped = '[{"arguments": {"a": [1]}, "name": "now"}]'
    assert _simple(parse_required(swapped)) == [("now", {"a": [1]})]
    assert _reassemble(_stream(ToolCallStreamer("required"), list(swapped)))[1][0]["arguments"] == '{"a": [1]}'
    # cut short (finish_reason "length"): the started call keeps the arguments text as written, nothing raises
    cut = parse_required('[{"name": "now", "arguments": {"a": ')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in cut] == [("now", '{"a": ')]
    assert parse_required('[{"name": "no') == [] and parse_required("") == []
    assert finish_reason_for(len(calls)) == "tool_calls"
    assert finish_reason_for(0) == "stop" and finish_reason_for(len(calls), "length") == "length"


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text.", "Just text.", []),
        (
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>',
            "Checking.",
            [("get_weather", {"city": "Oslo"}), ("now", {})],
        ),
        (
            '<tool_call>{"name": "now", "arguments": {oops}</tool_call> then '
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "now", "arguments": {oops}</tool_call> then '
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
            [],
        ),
        ('  <tool_call>\n  {"name": "get_weather", "parameters": {"city": "Rome"}}  ', None,
         [("get_weather", {"city": "Rome"})]),
        ('<tool_call>\n{"name": "now", "arguments": {"a": 1', '<tool_call>\n{"name": "now", "arguments": {"a": 1', []),
        ("a <tool_call", "a <tool_call", []),
    ],
)
def test_parse_auto(text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = parse_auto(text, NAMES)
    assert got_content == content
    assert _simple(got_calls) == calls


# ---- streaming ----------------------------------------------------------------------------------------
REQUIRED_ARGS = ['{ "city" : "Par\\"is}{ " ,"unit":"c", "n": [1.5, true, null]}', "{}"]
REQUIRED_OUT = (f'[\n  {{"name": "get_weather", "arguments":  {REQUIRED_ARGS[0]} \n}}, '
                f'{{ "name" : "now" , "arguments" : {REQUIRED_ARGS[1]} }} ]')
AUTO_OUT = ('I will look <b>that</b> up < ok.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>bad</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>\n'
            '<tool_call')
NAMED_OUT = ' {"city": "\\u00e9} ", "unit": "f", "n": -1.5e3, "ok": true, "z": [null, false]}\n'
CASES = [
    ("required", REQUIRED_OUT, None, REQUIRED_ARGS),
    ("named", NAMED_OUT, "get_weather", [NAMED_OUT.strip()]),
    ("auto", AUTO_OUT, None, None),
]


def _stream(streamer: ToolCallStreamer, pieces: list[str]) -> list[dict]:
    deltas = [d for piece in pieces for d in streamer.feed(piece)] + streamer.finish()
    for d in deltas:  # each delta is one of the two documented shapes
        assert list(d) in (["content"], ["tool_calls"]) and (d.get("content") or len(d.get("tool_calls", [])) == 1)
    return deltas


def _reassemble(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):  # a call's first delta: id, type, name and no arguments yet
                assert set(tc) == {"index", "id", "type", "function"} and tc["function"]["arguments"] == ""
                calls.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return content or None, calls


def _splits(text: str) -> list[list[str]]:
    rng = random.Random(1234)
    out = [list(text), [text]]
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        out.append([text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def _expected(mode: str, text: str, named: str | None) -> tuple[str | None, list[dict]]:
    if mode == "required":
        return None, parse_required(text)
    return (None, parse_named(named or "", text)) if mode == "named" else parse_auto(text, NAMES)


@pytest.mark.parametrize("mode, text, named, raw_args", CASES)
def test_streaming_reassembles_at_every_split(mode: str, text: str, named: str | None, raw_args: list | None) -> None:
    content, calls = _expected(mode, text, named)
    assert calls
    for pieces in _splits(text):
        got_content, got_calls = _reassemble(_stream(ToolCallStreamer(mode, NAMES, named), pieces))
        assert got_content == content
        assert [c["name"] for c in got_calls] == [c["function"]["name"] for c in calls]
        assert [json.loads(c["arguments"]) for c in got_calls] == [json.loads(c["function"]["arguments"])
                                                                  for c in calls]
        assert all(CALL_ID.fullmatch(c["id"]) for c in got_calls)
        if raw_args is not None:  # required / named: the arguments text exactly as the model wrote it
            assert [c["arguments"] for c in got_calls] == raw_args


def test_streaming_auto_content_and_holdback() -> None:
    content, calls = parse_auto(AUTO_OUT, NAMES)
    assert content == "I will look <b>that</b> up < ok.\n\n<tool_call>bad</tool_call>\n\n<tool_call"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    streamer = ToolCallStreamer("auto", NAMES)
    assert streamer.feed("Hi <tool_") == [{"content": "Hi"}]  # " <tool_" may start a call: held back
    assert streamer.feed("x") == [{"content": " <tool_x"}]
    assert streamer.finish() == []


def test_named_streaming_without_output_still_calls() -> None:
    streamer = ToolCallStreamer("named", NAMES, "now")
    deltas = streamer.feed("") + streamer.finish()
    assert [tc["function"]["name"] for d in deltas for tc in d["tool_calls"]] == ["now"]


@pytest.mark.parametrize("mode, text, named, raw_args", CASES)
def test_openai_client_accumulates_deltas(mode: str, text: str, named: str | None, raw_args: list | None) -> None:
    """The openai SDK's own stream accumulator (what client.chat.completions.stream uses) rebuilds the calls."""
    content, calls = _expected(mode, text, named)
    strict_tools = [{"type": "function", "function": {**t.model_dump(exclude_none=True)["function"], "strict": True}}
                    for t in TOOLS]
    state = ChatCompletionStreamState(input_tools=strict_tools)
    deltas = [{"role": "assistant", "content": ""}]
    deltas += _stream(ToolCallStreamer(mode, NAMES, named), list(text))
    for i, delta in enumerate(deltas + [{}]):
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None if i < len(deltas) else
                         finish_reason_for(len(calls))}],
        }))
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content or None) == content
    got = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == _simple(calls)
    assert [c.function.parsed_arguments for c in got] == [json.loads(c["function"]["arguments"]) for c in calls]
    assert len({c.id for c in got}) == len(got) and all(CALL_ID.fullmatch(c.id) for c in got)
