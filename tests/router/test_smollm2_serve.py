"""The default model through the whole stack: greedy text over HTTP equals the offline LLM's; structured outputs
and tool calls with the official openai client."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.router.conftest import deploy
from tests.structured_cases import SCHEMA_CASES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
MAX_TOKENS = 24
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"]}}}


@pytest.fixture(scope="module")
def model_dir():
    from conveyor.serving.models.loader import resolve_model_path

    try:
        return resolve_model_path("smollm2")
    except Exception as exc:  # no registry reachable and nothing cached
        pytest.skip(f"SmolLM2 is not available: {exc}")


@pytest.fixture(scope="module")
def client(serve_cluster: str, model_dir) -> Iterator[OpenAI]:
    args = {"model": str(model_dir), "served_model_name": "smollm2", "num_kv_blocks": 128,
            "torch_num_threads": 2}
    with deploy(args, "conveyor-test-smollm2", "/smollm2"):
        yield OpenAI(base_url=serve_cluster + "/smollm2/v1", api_key="x", timeout=120, max_retries=0)


def test_smollm2_http_matches_offline(client: OpenAI, model_dir) -> None:
    from conveyor.serving import LLM, SamplingParams

    offline = LLM(str(model_dir), num_kv_blocks=128)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = [offline.chat([{"role": "user", "content": p}], params)[0].text for p in PROMPTS]
    del offline
    for prompt, want in zip(PROMPTS, expected, strict=True):
        messages = [{"role": "user", "content": prompt}]
        got = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_TOKENS,
                                             temperature=0.0)
        assert got.choices[0].message.content == want
        streamed = client.chat.completions.create(model="smollm2", messages=messages, stream=True,
                                                  max_tokens=MAX_TOKENS, temperature=0.0)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want
    assert "Paris" in expected[0]


class Person(BaseModel):
    name: str
    age: int
    # Bounded: in its own indented layout, greedy SmolLM2 repeats "red", "blue", "green", ... until max_tokens.
    favourite_colors: list[Literal["red", "green", "blue"]] = Field(max_length=3)


def test_parse_with_a_pydantic_model(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Describe a person called Ada, aged 36, who likes red and blue."}]
    for temperature in (0.0, 0.8):
        out = client.chat.completions.parse(model="smollm2", messages=messages, response_format=Person,
                                            max_tokens=120, temperature=temperature, seed=7)
        person = out.choices[0].message.parsed
        assert isinstance(person, Person) and out.choices[0].finish_reason == "stop"


# Short answers on the real model (tests/serving/test_smollm2.py runs every test schema in process).
@pytest.mark.parametrize("case", [c for c in SCHEMA_CASES if c.name in ("primitives", "enums", "any_of")],
                         ids=lambda c: c.name)
def test_json_schema_outputs_validate_streamed_and_not(client: OpenAI, case) -> None:
    messages = [{"role": "user", "content": f"Give an example {case.name.replace('_', ' ')} as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema, "strict": True}}
    kwargs = dict(model="smollm2", messages=messages, max_tokens=120, temperature=0.0, response_format=fmt)
    plain = client.chat.completions.create(**kwargs).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    assert streamed == plain.message.content
    if plain.finish_reason == "stop":  # else cut at max_tokens: still a prefix the grammar allowed
        jsonschema.validate(json.loads(plain.message.content), case.schema)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls(client: OpenAI, stream: bool) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    choices = [("required", True), ("required", False), (named, True)]
    for choice, parallel in choices:
        kwargs = dict(model="smollm2", messages=messages, max_tokens=150, temperature=0.0,
                      tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice, parallel_tool_calls=parallel)
        if stream:
            with client.chat.completions.stream(**kwargs) as events:
                answer = events.get_final_completion().choices[0]
        else:
            answer = client.chat.completions.create(**kwargs).choices[0]
        assert answer.finish_reason == "tool_calls", answer
        calls = answer.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        tools = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            schema = tools[call.function.name]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
        if isinstance(choice, dict):
            assert calls[0].function.name == "get_weather"


def test_auto_tool_choice_streams_what_it_answers(client: OpenAI) -> None:
    messages = [{"role": "system", "content": "You call functions when they help."},
                {"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    kwargs = dict(model="smollm2", messages=messages, max_tokens=120, temperature=0.0, tools=[WEATHER_TOOL])
    plain = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as events:
        streamed = events.get_final_completion().choices[0]
    assert streamed.message.content == plain.message.content
    assert [c.function.model_dump() for c in streamed.message.tool_calls or []] == [
        c.function.model_dump() for c in plain.message.tool_calls or []]
    assert streamed.finish_reason == plain.finish_reason
    assert (plain.finish_reason == "tool_calls") == bool(plain.message.tool_calls)
    # A conversation that carries the call and its result goes back to the model as text it can read.
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    follow_up = messages + [{"role": "assistant", "content": None, "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model="smollm2", messages=follow_up, max_tokens=30, temperature=0.0,
                                            tools=[WEATHER_TOOL], tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
