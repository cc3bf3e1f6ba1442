"""A structured-output constraint is validated once on the path a request takes through `conveyor serve`: at the
ingress (a bad grammar is a 400 there), and never again in the replica's engine, which only compiles it. The
in-process engine (LLM), which has no ingress, still validates what it is given."""
from __future__ import annotations

import asyncio
import json

import pytest

from conveyor.router.parse_pool import parse_body
from conveyor.router.protocol import CompletionRequest
from conveyor.serving import grammar
from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig
from conveyor.serving.engine import LLMEngine
from conveyor.serving.engine_process import ProcessEngine
from conveyor.serving.request import SamplingParams, StructuredOutputsParams


def _config(model_dir) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(model_dir)), cache=CacheConfig(num_blocks=64, block_size=4))


@pytest.fixture
def validations(monkeypatch) -> list[str]:
    """The kind of every constraint grammar.validate checks in this process, in order."""
    calls: list[str] = []
    real = grammar.validate

    def counting(params: StructuredOutputsParams) -> str:
        calls.append(params.kind)
        return real(params)

    monkeypatch.setattr(grammar, "validate", counting)
    return calls


@pytest.mark.slow  # starts an engine process of its own (2-6 s): `make test` runs it, the inner loop does not
def test_the_served_path_validates_a_grammar_once(tiny_model_dir, validations) -> None:
    body = {"model": "m", "prompt": "The quick", "max_tokens": 4, "temperature": 0.0,
            "structured_outputs": {"choice": ["yes", "no"]}}
    request = parse_body(json.dumps(body).encode(), CompletionRequest)  # what the ingress runs on its parse pool
    assert validations == ["choice"]
    params = request.to_sampling_params()
    assert params.structured.validated
    engine = ProcessEngine.from_config(_config(tiny_model_dir), torch_num_threads=1)

    async def collect() -> list:
        return [o async for o in engine.generate("The quick", params)]

    try:
        outputs = asyncio.run(asyncio.wait_for(collect(), 60))
    finally:
        engine.shutdown()
    assert outputs[-1].text in ("yes", "no")  # the grammar was compiled and applied
    assert validations == ["choice"]  # ... without being checked again


def test_the_in_process_engine_validates_what_it_is_given(tiny_model_dir, validations) -> None:
    engine = LLMEngine(_config(tiny_model_dir))
    choice = StructuredOutputsParams("choice", '["a", "b"]')
    engine.make_request("The quick", SamplingParams(max_tokens=2, structured=choice))
    assert validations == ["choice"]
    with pytest.raises(ValueError, match="regex"):
        engine.make_request("The quick", SamplingParams(max_tokens=2, structured=StructuredOutputsParams("regex", "(")))
    assert validations == ["choice", "regex"]
    # A constraint the ingress validated is compiled only: the ingress's check is not repeated.
    engine.make_request("The quick", SamplingParams(max_tokens=2, structured=StructuredOutputsParams(
        "choice", '["a", "b"]', validated=True)))
    assert validations == ["choice", "regex"]
    assert StructuredOutputsParams("choice", '["a"]', validated=True) == StructuredOutputsParams("choice", '["a"]')
