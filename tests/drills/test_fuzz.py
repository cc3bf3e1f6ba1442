"""Fuzzing: hypothesis on the protocol models, schemathesis against the live app's OpenAPI schema.

The models must turn any JSON into either a validated request or a ValidationError (a ValueError), and a
validated request must always map onto SamplingParams (the ingress does that outside any try: an exception
there would be a 500). Against the server: no 5xx for anything the schema generator sends, valid or not, the
server keeps serving, and no KV block is leaked.
"""
from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from conveyor.router.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.serving.request import SamplingParams
from tests.serve.conftest import deploy, engine_state, wait_until

pytestmark = pytest.mark.timeout(240)

APP = "conveyor-drill-fuzz"

# ---- hypothesis on the protocol models ----------------------------------------------------------------------
SAMPLING_FIELDS = ["model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n",
                   "stream", "stream_options", "ignore_eos", "include_stop_str_in_output", "user", "max_tokens"]
COMPLETION_FIELDS = [*SAMPLING_FIELDS, "prompt", "logprobs", "echo"]
CHAT_FIELDS = [*SAMPLING_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs"]

# Scalars at the edges that bite: huge ints, signed zero, nan/inf, lone surrogates, empty strings.
scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2, 70) | st.floats(allow_nan=True)
           | st.floats(-1, 3) | st.text(max_size=8) | st.sampled_from(["", "\ud800", "text", "user", "length"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage"])
                                             | st.text(max_size=4), inner, max_size=4), max_leaves=12)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"])},
                                          optional={"content": json_values}), max_size=3)


def payloads(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Dicts over the model's own field names (so validators run) plus a stray key, with random JSON values."""
    special = {"prompt": st.text(max_size=20) | st.lists(st.integers(-1, 1 << 40), max_size=4) | json_values,
               "messages": messages | json_values}
    value = {f: special.get(f, json_values) for f in fields}
    return st.fixed_dictionaries({}, optional={**value, "unknown_field": json_values})


def _check_model(model: type[CompletionRequest] | type[ChatCompletionRequest], data: dict[str, Any]) -> None:
    try:
        req = model.model_validate(data)
    except ValidationError:  # a ValueError subclass: the ingress turns it into a 400
        return
    for k in range(req.n):
        assert isinstance(req.to_sampling_params(k), SamplingParams)
    if isinstance(req, CompletionRequest):
        assert req.prompts()
    else:
        assert all(isinstance(m["content"], str) for m in req.conversation())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=payloads(COMPLETION_FIELDS))
def test_completion_request_validation_never_crashes(data: dict[str, Any]) -> None:
    _check_model(CompletionRequest, data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=payloads(CHAT_FIELDS))
def test_chat_request_validation_never_crashes(data: dict[str, Any]) -> None:
    _check_model(ChatCompletionRequest, data)


# ---- schemathesis against the live server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_url(serve_cluster: str, tiny_model_dir):
    # A short context keeps every valid request (up to 64 choices) cheap on the tiny model.
    args = {"model": str(tiny_model_dir), "served_model_name": "tiny", "num_kv_blocks": 64, "max_num_seqs": 8,
            "max_model_len": 64, "torch_num_threads": 1, "request_router_class": None}
    with deploy(args, APP, "/drill-fuzz"):
        yield serve_cluster + "/drill-fuzz"


def test_openapi_schema_documents_request_bodies(base_url: str) -> None:
    schema = httpx.get(base_url + "/openapi.json", timeout=10).json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "max_tokens", "n", "stream"} <= body["properties"].keys()
    assert "/v1/chat/completions" in schema["paths"]


def test_schemathesis_finds_no_server_error(base_url: str) -> None:
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json", timeout=10)
    cases = schema.as_strategy(GenerationMode.POSITIVE) | schema.as_strategy(GenerationMode.NEGATIVE)
    seen: list[int] = []

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, timeout=60)
        seen.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    run()
    assert len(seen) >= 30 and all(s < 500 for s in seen), seen
    # Still serving, and nothing the fuzzer sent left a sequence or a block behind.
    ok = httpx.post(base_url + "/v1/completions", json={"prompt": "still alive", "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200, ok.text
    state = wait_until(lambda: (s := engine_state(APP))["num_block_tables"] == 0 and s, 15, "idle engine")
    assert state["num_free_blocks"] == state["num_blocks"] and state["num_waiting"] == state["num_running"] == 0
    print(f"\nschemathesis: {len(seen)} calls, statuses {sorted(set(seen))}")
