"""The default model through the whole stack: greedy text over HTTP equals the offline LLM's."""
from __future__ import annotations

import pytest
from openai import OpenAI

from tests.serve.conftest import deploy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir():
    from conveyor.serving.models.loader import resolve_model_path

    try:
        return resolve_model_path("smollm2")
    except Exception as exc:  # no registry reachable and nothing cached
        pytest.skip(f"SmolLM2 is not available: {exc}")


def test_smollm2_http_matches_offline(serve_cluster: str, model_dir) -> None:
    from conveyor.serving import LLM, SamplingParams

    offline = LLM(str(model_dir), num_kv_blocks=128)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = [offline.chat([{"role": "user", "content": p}], params)[0].text for p in PROMPTS]
    del offline
    args = {"model": str(model_dir), "served_model_name": "smollm2", "num_kv_blocks": 128,
            "torch_num_threads": 2}
    with deploy(args, "conveyor-test-smollm2", "/smollm2"):
        client = OpenAI(base_url=serve_cluster + "/smollm2/v1", api_key="x", timeout=120, max_retries=0)
        for prompt, want in zip(PROMPTS, expected, strict=True):
            messages = [{"role": "user", "content": prompt}]
            got = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0.0)
            assert got.choices[0].message.content == want
            streamed = client.chat.completions.create(model="smollm2", messages=messages, stream=True,
                                                      max_tokens=MAX_TOKENS, temperature=0.0)
            assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want
    assert "Paris" in expected[0]
