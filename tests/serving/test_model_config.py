"""The engine reads config.json without the model's config class (serving/models/loader.py read_config): what the
model and the engine read from it must equal what AutoConfig gives, and the weights built from it the same model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, MistralConfig, Qwen2Config

from conveyor.serving.models.llama import LlamaForCausalLM
from conveyor.serving.models.loader import build_model, read_config
from conveyor.serving.models.rotary import head_dim, rope_inv_freq

# Every attribute conveyor/serving/ reads from a model config, with the default its getattr uses.
READ = {"model_type": None, "hidden_size": None, "num_attention_heads": None, "num_hidden_layers": None,
        "intermediate_size": None, "vocab_size": None, "rms_norm_eps": None, "max_position_embeddings": 2048,
        "num_key_value_heads": None, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "sliding_window": None, "use_sliding_window": True}


def as_read(config) -> dict:
    values = {key: getattr(config, key, default) for key, default in READ.items()}
    return values | {"head_dim": head_dim(config), "inv_freq": rope_inv_freq(config).tolist()}


def saved(tmp_path: Path, config) -> Path:
    config.save_pretrained(tmp_path)
    return tmp_path


@pytest.fixture(params=["tiny_llama", "tiny_qwen", "qwen2_scaled", "mistral"])
def model_dir(request, tmp_path: Path) -> Path:
    small = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    if request.param == "tiny_llama":
        return request.getfixturevalue("tiny_model_dir")
    if request.param == "tiny_qwen":
        return request.getfixturevalue("tiny_qwen_dir")
    if request.param == "qwen2_scaled":
        scaling = {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0}
        return saved(tmp_path, Qwen2Config(**small, rope_parameters=scaling, tie_word_embeddings=True))
    return saved(tmp_path, MistralConfig(**small, sliding_window=256))


def test_read_config_reads_what_autoconfig_reads(model_dir: Path) -> None:
    raw = json.loads((model_dir / "config.json").read_text())
    config = read_config(model_dir)
    assert type(config).__name__ == "PreTrainedConfig", "a complete config.json takes the fast path"
    assert as_read(config) == as_read(AutoConfig.from_pretrained(model_dir)), raw


def test_an_incomplete_config_takes_the_model_class_defaults(tmp_path: Path) -> None:
    raw = json.loads((saved(tmp_path, MistralConfig(vocab_size=384, hidden_size=64, num_attention_heads=4))
                      / "config.json").read_text())
    del raw["num_key_value_heads"], raw["max_position_embeddings"]  # Mistral's defaults: 8 and 131072
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = read_config(tmp_path)
    assert (config.num_key_value_heads, config.max_position_embeddings) == (8, 131072)


def _to_empty_build(config, dtype: torch.dtype):  # noqa: ANN001, ANN202 - what build_model did before
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=torch.device("cpu"))
    model.model.rotary_emb.reset_tables()
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_built_from_it_is_the_one_to_empty_built(tiny_model_dir: Path, dtype: torch.dtype) -> None:
    fast = build_model(read_config(tiny_model_dir), dtype, torch.device("cpu"))
    exact = _to_empty_build(AutoConfig.from_pretrained(tiny_model_dir), dtype)

    def layout(model) -> dict:  # noqa: ANN001
        tensors = list(model.named_parameters()) + list(model.named_buffers())
        return {n: (t.shape, t.dtype, t.device, isinstance(t, torch.nn.Parameter)) for n, t in tensors}

    assert layout(fast) == layout(exact)
    assert torch.equal(fast.model.rotary_emb.cos, exact.model.rotary_emb.cos)
    assert torch.equal(fast.model.rotary_emb.sin, exact.model.rotary_emb.sin)
