"""Bad input is a 4xx, never a 5xx (issue 39, item 2), without Ray: the JSON guard the ingress parses bodies with,
and the request models' nested JSON strings (structured outputs, tool-call arguments), chat templates that raise."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from conveyor.router import json_limits
from conveyor.router.protocol import ChatCompletionRequest

USER = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("text", [
    "[" * 100_000,  # RecursionError in json.loads
    nested(json_limits.MAX_JSON_DEPTH + 1),
    '{"a": ' + nested(json_limits.MAX_JSON_DEPTH) + "}",
    '{"max_tokens": ' + "9" * 5000 + "}",  # past int()'s digit limit: a plain ValueError
    '{"temperature": NaN}', '{"x": -Infinity}',
    '{"prompt": "\\ud800"}', '{"\\udfff": 1}', '{"a": [{"b": "x\\ud83d"}]}',
    b'{"prompt": "\xff"}',
    '{"prompt": ',
])
def test_hostile_json_is_a_value_error(text: str | bytes) -> None:
    with pytest.raises(ValueError):
        json_limits.loads(text)


def test_limits_are_exact_and_valid_input_passes() -> None:
    assert json_limits.loads(nested(json_limits.MAX_JSON_DEPTH)) == json.loads(nested(json_limits.MAX_JSON_DEPTH))
    assert json_limits.loads('{"emoji": "\\ud83d\\ude00", "n": ' + "9" * 4000 + "}")["emoji"] == "\U0001F600"
    many = '{"a": [' + ", ".join(["[1]"] * 10_000) + "]}"  # many brackets, little depth
    assert len(json_limits.loads(many)["a"]) == 10_000


def test_depth_errors_are_limit_errors() -> None:
    for text in ("[" * 100_000, nested(65), '["\\ud800"]'):
        with pytest.raises(json_limits.JsonLimitError):
            json_limits.loads(text)


def test_deep_structured_output_strings_are_validation_errors() -> None:
    deep = '{"type": "object", "properties": {"a": ' + '{"anyOf": [' * 200 + "{}" + "]}" * 200 + "}}"
    with pytest.raises(ValidationError, match="nested"):
        ChatCompletionRequest.model_validate({"messages": USER, "structured_outputs": {"json": deep}})
    with pytest.raises(ValidationError, match="nested"):
        ChatCompletionRequest.model_validate({"messages": USER, "structured_outputs": {"json": "[" * 100_000}})
    with pytest.raises(ValidationError, match="not valid JSON"):
        ChatCompletionRequest.model_validate({"messages": USER, "structured_outputs": {"json": '{"a": ' + "1" * 5000
                                                                                       + "}"}})


def _tool_turn(arguments: str) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"messages": [*USER, {"role": "assistant", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}


def test_deep_tool_call_arguments_are_validation_errors_and_plain_text_stays_lenient() -> None:
    with pytest.raises(ValidationError, match="nested"):
        ChatCompletionRequest.model_validate(_tool_turn('{"a": ' + "[" * 100_000 + "}"))
    with pytest.raises(ValidationError, match="nested"):
        ChatCompletionRequest.model_validate(_tool_turn(nested(100)))
    # Not JSON at all: rendered as text, as before.
    req = ChatCompletionRequest.model_validate(_tool_turn("not json {"))
    assert "not json {" in req.conversation()[1]["content"]


def test_a_chat_template_that_raises_is_a_value_error(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    from conveyor.serving.detokenizer import apply_chat_template

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                               "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
                               "{% endif %}{{ m['content'] }}{% endfor %}")
    assert apply_chat_template(tokenizer, USER) == "hi"
    with pytest.raises(ValueError, match="roles must alternate"):
        apply_chat_template(tokenizer, [*USER, *USER])


def test_error_codes_the_ingress_answers_with() -> None:
    with pytest.raises(json_limits.JsonLimitError) as surrogate:
        json_limits.loads('{"prompt": "a\\ud800b"}')
    assert surrogate.value.code == "invalid_value"  # a bad string value, as the models' own check says
    with pytest.raises(json_limits.JsonLimitError) as deep:
        json_limits.loads(nested(100))
    assert deep.value.code == "invalid_json"
