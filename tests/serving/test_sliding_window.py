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
