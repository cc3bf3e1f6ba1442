"""A request's tools under a chat template without a system role (Gemma 2's as Google ships it): the tools section
opens the first user turn, as Gemma 3's template folds a system prompt into it, instead of a system message the
template refuses; a template with a system role (ChatML) keeps the section as its system message, and a system
message the client wrote stays the client's error under Gemma 2's template, as transformers has it."""
from __future__ import annotations

import pytest

from conveyor.router.protocol import ChatCompletionRequest
from conveyor.serving.detokenizer import apply_chat_template, template_takes_system_role
from tests.serving.test_model_gemma_phi import GEMMA2_TEMPLATE, GEMMA3_TEMPLATE
from tests.tiny_model import CHATML

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
ASK = {"role": "user", "content": "Weather in Paris?"}


@pytest.fixture()
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _conversation(messages: list[dict], tool_choice: object = "auto") -> list[dict[str, str]]:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "tools": [WEATHER], "tool_choice": tool_choice}).conversation()


def _section(conversation: list[dict[str, str]]) -> str:
    assert conversation[0]["role"] == "system" and conversation[0]["content"].startswith("# Tools")
    return conversation[0]["content"]


def test_gemma2_template_takes_the_tools_in_the_first_user_turn(tokenizer):
    conversation = _conversation([ASK])
    section = _section(conversation)
    tokenizer.chat_template = GEMMA2_TEMPLATE
    assert not template_takes_system_role(tokenizer)
    prompt = apply_chat_template(tokenizer, conversation)
    assert prompt.endswith(f"<start_of_turn>user\n{section}\n\nWeather in Paris?<end_of_turn>\n"
                           "<start_of_turn>model\n")
    assert prompt.count("<start_of_turn>") == 2
    # the user turn Gemma 3's template renders for the same section as a system prompt
    tokenizer.chat_template = GEMMA3_TEMPLATE
    assert template_takes_system_role(tokenizer)
    plain = apply_chat_template(tokenizer, [{"role": "system", "content": section}, ASK])
    assert prompt.split("<end_of_turn>")[0] == plain.split("<end_of_turn>")[0]


def test_a_tool_call_round_trip_under_gemma2(tokenizer):
    """Calls and results alternate as Gemma 2's template demands; a named choice says which function."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "18C"}]
    tokenizer.chat_template = GEMMA2_TEMPLATE
    choice = {"type": "function", "function": {"name": "get_weather"}}
    prompt = apply_chat_template(tokenizer, _conversation(messages, choice))
    assert prompt.count("<start_of_turn>user\n") == 2 and prompt.count("<start_of_turn>model\n") == 2
    assert "You must call the function get_weather.\n\nWeather in Paris?<end_of_turn>" in prompt
    assert "<tool_response>\n18C\n</tool_response>" in prompt


def test_chatml_keeps_the_section_as_its_system_message(tokenizer):
    tokenizer.chat_template = CHATML
    assert template_takes_system_role(tokenizer)
    conversation = _conversation([ASK])
    prompt = apply_chat_template(tokenizer, conversation)
    assert prompt.startswith(f"<|im_start|>system\n{_section(conversation)}<|im_end|>\n<|im_start|>user\n")
    assert "conveyor" not in prompt  # the section's mark is not rendered


def test_a_client_system_message_stays_refused_under_gemma2(tokenizer):
    tokenizer.chat_template = GEMMA2_TEMPLATE
    conversation = _conversation([{"role": "system", "content": "Be brief."}, ASK])
    with pytest.raises(ValueError, match="System role not supported"):
        apply_chat_template(tokenizer, conversation)
