"""Every supported model family behind the HTTP API: completions, chat, and a streamed tool call, each from a tiny
random checkpoint that transformers' own classes built (tests/tiny_model.py). Token-level agreement with
transformers is tests/serving/test_model_families.py's; this checks that a family's checkpoint, chat template and
engine come up and answer through Serve."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from openai import OpenAI

from tests.router.conftest import DEPLOY_TIMEOUT_S, _app_status, deploy, wait_until
from tests.tiny_model import FAMILIES, build_tiny_model

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny"
# No arguments at all: the grammar forces `{}`, so a random model completes the call within a few tokens.
NOW_TOOL = {"type": "function", "function": {"name": "now", "description": "current time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


SERVED = sorted(set(FAMILIES) - {"llama"})  # llama: tests/router/test_api.py


@pytest.fixture(scope="module")
def clients(serve_cluster: str, tmp_path_factory) -> Iterator[dict[str, OpenAI]]:
    """One application per family, all deployed at once (each replica asks for a quarter CPU so all fit): the
    starts overlap instead of adding up."""
    with ExitStack() as stack:
        names = {}
        for family in SERVED:
            # The tool-call prompt the chat template renders is ~500 tokens of this tiny vocabulary.
            model_dir = build_tiny_model(tmp_path_factory.mktemp(f"serve-{family}"), family,
                                         max_position_embeddings=2048)
            args = {"model": str(model_dir), "served_model_name": MODEL, "num_kv_blocks": 160, "max_num_seqs": 4,
                    "num_cpus": 0.25, "torch_num_threads": 1, "request_router_class": None,
                    "engine_process": False}  # the engine on a thread of the replica: one process fewer to start
            names[family] = f"conveyor-test-family-{family}"
            stack.enter_context(deploy(args, names[family], f"/family-{family}", wait=False))
        for name in names.values():
            wait_until(lambda name=name: _app_status(name) == "RUNNING", DEPLOY_TIMEOUT_S, f"{name} to run",
                       interval_s=0.25)
        yield {family: OpenAI(base_url=f"{serve_cluster}/family-{family}/v1", api_key="unused", timeout=60,
                              max_retries=0) for family in SERVED}


@pytest.fixture(params=SERVED)
def client(request, clients: dict[str, OpenAI]) -> OpenAI:
    return clients[request.param]


def test_completion_and_chat(client: OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6,
                                           temperature=0.0, extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 6
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is Paris?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                          temperature=0.0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6


def test_streamed_tool_call(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What time is it?"}], tools=[NOW_TOOL],
        # Room for the whitespace a random model may write inside `{}` (the grammar bounds each gap).
        tool_choice={"type": "function", "function": {"name": "now"}}, max_completion_tokens=128, temperature=0.0,
        stream=True)
    names, arguments, finish = [], "", None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                if call.function.name:
                    names.append(call.function.name)
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert names == ["now"]
    assert json.loads(arguments) == {}, (arguments, finish)
    assert finish in ("stop", "tool_calls")
