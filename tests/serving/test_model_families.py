"""Each supported family end to end through the engine: greedy tokens equal transformers' on a tiny random
checkpoint that transformers' own classes built, through plain steps, chunked prefill mixed with decodes,
preemption and prefix-cache hits. (Per-step logits against transformers: tests/serving/test_model.py.)"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.serving import LLM, SamplingParams
from conveyor.serving.attention import uniform_sliding_window
from conveyor.serving.models.decode_stack import unavailable_reason
from tests.serving.test_engine import PROMPTS
from tests.tiny_model import build_tiny_model

# llama and qwen2: tests/serving/test_engine.py, tests/serving/test_model.py
FAMILIES = ["qwen3", "qwen3_moe", "mixtral", "mistral", "gemma2", "gemma3", "phi3", "phi4_mini"]
# variant -> (family of tests/tiny_model.py, config fields over the family's). Phi-4-mini: Phi-3's class rotating
# the first 3/4 of each head, tied embeddings, no window.
VARIANTS = {"phi4_mini": ("phi3", dict(partial_rotary_factor=0.75, tie_word_embeddings=True, sliding_window=None))}


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    family, overrides = VARIANTS.get(request.param, (request.param, {}))
    return build_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)


def _hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(num_tokens):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def expected(family_dir):
    llm = LLM(str(family_dir), num_kv_blocks=256, block_size=4)
    prompt_ids = [llm.engine.tokenize(p) for p in PROMPTS]
    lengths = [12 + 5 * i for i in range(len(PROMPTS))]
    hf = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32).eval()
    return prompt_ids, lengths, [_hf_greedy(hf, ids, n) for ids, n in zip(prompt_ids, lengths, strict=True)]


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=512),
    dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=16),  # every long prompt chunked
    dict(num_kv_blocks=40, block_size=4, max_num_batched_tokens=24),  # too small for all: preemption
    dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=512, attention_backend="torch"),
], ids=["plain", "chunked", "preempting", "torch-attention"])
def test_greedy_matches_transformers(family_dir, expected, engine_kwargs):
    prompt_ids, lengths, reference = expected
    llm = LLM(str(family_dir), **engine_kwargs)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    assert [r.token_ids for r in llm.generate(prompt_ids, params)] == reference
    if engine_kwargs["num_kv_blocks"] == 40 and uniform_sliding_window(llm.engine.model) is None:
        # (where every layer slides, blocks behind the window go back to the pool and 40 are enough for all)
        assert llm.engine.scheduler.num_preemptions_total > 0
    # The same prompts again: their full blocks come from the prefix cache, and the tokens must not change.
    again = llm.generate(prompt_ids, params)
    assert [r.token_ids for r in again] == reference
    if engine_kwargs["num_kv_blocks"] == 256:
        assert sum(r.num_cached_tokens for r in again) > 0


def test_the_cpu_decode_loop_is_skipped_with_a_reason(family_dir):
    llm = LLM(str(family_dir), num_kv_blocks=64, block_size=4)
    assert llm.engine.model.decode_stack is None
    assert unavailable_reason(llm.engine.model) is not None
