"""Sliding windows on the model side: which layers of a Llama-family config slide, as transformers decides."""
from __future__ import annotations

import pytest
from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config

from conveyor.serving.models.llama import LlamaModel, layer_sliding_window

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)


@pytest.mark.parametrize(("config", "windows"), [
    (LlamaConfig(**SMALL), [None] * 4),
    (MistralConfig(**SMALL, sliding_window=16), [16] * 4),
    (MistralConfig(**SMALL, sliding_window=None), [None] * 4),
    (MixtralConfig(**SMALL, sliding_window=16), [16] * 4),
    (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=2), [None, None, 16, 16]),
    (Qwen2Config(**SMALL, use_sliding_window=False, sliding_window=16, max_window_layers=0), [None] * 4),
    (Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16,
                 layer_types=["sliding_attention", "full_attention"] * 2), [16, None, 16, None]),
], ids=["llama", "mistral", "mistral-no-window", "mixtral", "qwen2-max-window-layers", "qwen2-off",
        "qwen2-layer-types"])
def test_layer_windows(config, windows: list[int | None]) -> None:  # noqa: ANN001 - a transformers config
    assert [layer_sliding_window(config, i) for i in range(4)] == windows
    model = LlamaModel(config, "torch")
    assert [layer.self_attn.attn.sliding_window for layer in model.layers] == windows


def test_qwen2_without_layer_types_in_its_file() -> None:
    """A config.json written before layer_types existed: max_window_layers decides."""
    config = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=3)
    config.layer_types = None
    assert [layer_sliding_window(config, i) for i in range(4)] == [None, None, None, 16]


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("mistral"), "mistral")


def _hf_greedy(model_dir, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.serving.test_model_families import _hf_greedy as greedy

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [greedy(hf, ids, num_tokens) for ids in prompts]


PROMPT_IDS = [[(5 * i + 3 * j) % 300 + 4 for j in range(23 + 9 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def mistral_expected(mistral_dir) -> list[list[int]]:
    return _hf_greedy(mistral_dir, PROMPT_IDS, 24)


def test_engine_frees_blocks_behind_the_window(mistral_dir, mistral_expected) -> None:
    """Every layer slides (window 8): the engine's cache frees blocks behind it, four 23-50-token prompts with 24
    new tokens each run in 20 blocks of 4 (80 tokens) without a preemption, and the tokens are transformers'."""
    from conveyor.serving import LLM, SamplingParams

    llm = LLM(str(mistral_dir), num_kv_blocks=20, block_size=4, max_num_batched_tokens=16)
    assert llm.engine.kv_cache.sliding_window == 8
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPT_IDS, [params] * len(PROMPT_IDS))
    assert [o.token_ids for o in outputs] == mistral_expected
    assert llm.engine.kv_cache.num_window_freed_blocks > 0
    assert llm.engine.scheduler.num_preemptions_total == 0
    if llm.engine.attention_backend == "cpu":  # the C++ decode loop passes no window: it must decline
        from conveyor.serving.models.decode_stack import unavailable_reason

        assert "sliding window" in unavailable_reason(llm.engine.model)


def test_engine_preempts_requests_with_freed_blocks(mistral_dir, mistral_expected) -> None:
    """19 blocks, the least the longest request fits in, and every prompt twice: requests are preempted after
    giving blocks back, recompute (hitting what the prefix cache still holds) and end with transformers' tokens."""
    from conveyor.serving import LLM, SamplingParams

    llm = LLM(str(mistral_dir), num_kv_blocks=19, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPT_IDS * 2, [params] * 2 * len(PROMPT_IDS))
    assert [o.token_ids for o in outputs] == mistral_expected * 2
    assert llm.engine.scheduler.num_preemptions_total > 0 and llm.engine.kv_cache.num_window_freed_blocks > 0


def test_qwen2_windows_in_upper_layers_only(tmp_path) -> None:
    """Qwen2 with use_sliding_window and max_window_layers 1: layer 0 full, layer 1 windowed. Nothing is freed
    (layer 0 reads the whole context) and the tokens are transformers'."""
    from conveyor.serving import LLM, SamplingParams
    from tests.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path, "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    llm = LLM(str(model_dir), num_kv_blocks=128, block_size=4)
    layers = llm.engine.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, 8]
    assert llm.engine.kv_cache.sliding_window is None
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPT_IDS[:2], [params] * 2)
    assert [o.token_ids for o in outputs] == _hf_greedy(model_dir, PROMPT_IDS[:2], 12)
