"""Amplification caps (issue 39, item 3; docs/limits.md): a small request cannot buy unbounded work per step or
per parse, and the duplicate-tool check is linear."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from conveyor.router import protocol, tool_schema
from conveyor.router.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.serving import request as serving_request
from conveyor.serving.request import SamplingParams

USER = {"role": "user", "content": "hi"}


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(("field", "at_cap", "past_cap"), [
    ("stop", ["s"] * serving_request.MAX_STOP_STRINGS, ["s"] * (serving_request.MAX_STOP_STRINGS + 1)),
    ("stop", ["x" * serving_request.MAX_STOP_STRING_CHARS], ["x" * (serving_request.MAX_STOP_STRING_CHARS + 1)]),
    ("stop_token_ids", list(range(serving_request.MAX_STOP_TOKEN_IDS)),
     list(range(serving_request.MAX_STOP_TOKEN_IDS + 1))),
    ("logit_bias", {str(i): 1.0 for i in range(serving_request.MAX_LOGIT_BIAS_ENTRIES)},
     {str(i): 1.0 for i in range(serving_request.MAX_LOGIT_BIAS_ENTRIES + 1)}),
])
def test_sampling_caps_in_the_api_and_the_engine(field: str, at_cap: object, past_cap: object) -> None:
    ok = CompletionRequest.model_validate({"prompt": "x", field: at_cap})
    ok.to_sampling_params()
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", field: past_cap})
    engine_value = ({int(k): v for k, v in past_cap.items()} if isinstance(past_cap, dict) else tuple(past_cap))
    with pytest.raises(ValueError, match="at most"):  # LLM in process: the same caps
        SamplingParams(**{field: engine_value})


def test_message_and_tool_caps() -> None:
    ChatCompletionRequest.model_validate({"messages": [USER] * protocol.MAX_MESSAGES})
    with pytest.raises(ValidationError, match="messages"):
        ChatCompletionRequest.model_validate({"messages": [USER] * (protocol.MAX_MESSAGES + 1)})
    tools = [tool(f"f{i}") for i in range(protocol.MAX_TOOLS)]
    ChatCompletionRequest.model_validate({"messages": [USER], "tools": tools})
    with pytest.raises(ValidationError, match="tools"):
        ChatCompletionRequest.model_validate({"messages": [USER], "tools": [*tools, tool("one_more")]})


def test_duplicate_tools_are_still_named() -> None:
    with pytest.raises(ValidationError, match="duplicate tool names: a, b"):
        ChatCompletionRequest.model_validate({"messages": [USER], "tools": [tool("b"), tool("a"), tool("b"),
                                                                             tool("a"), tool("c")]})


def test_the_duplicate_tool_check_is_linear() -> None:
    # Past the request cap on purpose: the check itself must not be quadratic (a list.count per name took
    # seconds here for 30,000 names).
    tools = [SimpleNamespace(function=SimpleNamespace(name=f"f{i}")) for i in range(30_000)]
    start = time.perf_counter()
    tool_schema.check_tools(tools, None)
    assert time.perf_counter() - start < 0.25
