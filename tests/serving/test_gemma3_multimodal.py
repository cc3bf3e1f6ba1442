"""A Gemma 3 multimodal checkpoint (Gemma3ForConditionalGeneration, a config with text_config and vision_config)
served for text prompts: its language model against transformers' own multimodal model on text-only input, per-step
logits (within ATOL, float32) and the engine's greedy tokens; the vision tower is never read, with one logged line.
"""
from __future__ import annotations

import json

import pytest
import torch

from conveyor.serving import LLM, SamplingParams
from conveyor.serving.models.gemma import Gemma3ForConditionalGeneration
from conveyor.serving.models.loader import load_model, read_config
from tests.serving.test_model import (
    TINY,
    Harness,
    _prompt,
    _randomize,
    _save_tokenizer,
    assert_rows_match,
)
from tests.serving.test_rope_context import _hf_greedy

TEXT = dict(TINY, sliding_window=4, query_pre_attn_scalar=32, layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=5.0)  # which transformers' multimodal class does not apply
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=8)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """(transformers' Gemma3ForConditionalGeneration, its saved folder)."""
    from transformers import Gemma3Config
    from transformers import Gemma3ForConditionalGeneration as HFGemma3

    path = tmp_path_factory.mktemp("gemma3_mm")
    config = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_index=255,
                          boi_token_index=253, eoi_token_index=254)
    torch.manual_seed(0)
    hf = HFGemma3(config)
    hf.config._attn_implementation = "eager"
    _randomize(hf)
    hf.eval()
    hf.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return hf, path


def test_the_folder_holds_a_vision_tower(multimodal):
    _, path = multimodal
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForConditionalGeneration"] and "vision_config" in raw
    config = read_config(path)
    assert config.model_type == "gemma3_text" and config.architectures == ["Gemma3ForConditionalGeneration"]
    assert config.hidden_size == TINY["hidden_size"] and config.rope_parameters  # the text config, with defaults


def test_logits_match_transformers_multimodal_model_on_text(multimodal, capfd):
    hf, path = multimodal
    ours, _, tokenizer = load_model(str(path), torch.float32, torch.device("cpu"))
    assert isinstance(ours, Gemma3ForConditionalGeneration) and tokenizer.eos_token == "t2"
    logged = capfd.readouterr().err
    assert logged.count("vision tower") == 1
    h = Harness(ours)
    seq = h.new_seq(_prompt(11, 1))
    for chunk in (6, 5):  # the second chunk reads keys past the local layer's window
        (logits,) = h.step([(seq, chunk)])
        assert_rows_match(hf, seq, logits)
    for _ in range(3):
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = h.step([(seq, 1)])
        assert_rows_match(hf, seq, logits)


def test_engine_greedy_tokens(multimodal):
    hf, path = multimodal
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)  # prompts chunked
    prompts = [_prompt(n, seed) for n, seed in ((3, 1), (12, 2), (7, 3))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
    assert got == [_hf_greedy(hf, p, 6) for p in prompts]


def test_weight_names_of_both_layouts(multimodal):
    """The layout transformers saves and the hub holds, and transformers 5's module names; vision names skipped."""
    ours, _, _ = load_model(str(multimodal[1]), torch.float32, torch.device("cpu"))
    names = {"language_model.model.layers.0.self_attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
             "model.language_model.embed_tokens.weight": "model.embed_tokens.weight",
             "language_model.lm_head.weight": "lm_head.weight", "model.norm.weight": "model.norm.weight"}
    renamed = ours.checkpoint_weights((name, torch.zeros(1)) for name in names)
    assert [n for n, _ in renamed] == list(names.values())
    vision = ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "model.multi_modal_projector.x")
    assert all(n.startswith(ours.SKIPPED_PREFIXES) for n in vision)


def test_a_hub_style_folder(multimodal, tmp_path):
    """As Google's folders hold it: a sparse text_config (the config class's defaults fill the rest, as
    transformers reads it) and the vision tower under vision_tower.vision_model.*."""
    import shutil

    from safetensors.torch import load_file, save_file

    hf, path = multimodal
    folder = shutil.copytree(path, tmp_path / "hub")
    raw = json.loads((folder / "config.json").read_text())
    kept = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "sliding_window",
            "query_pre_attn_scalar", "layer_types")
    raw["text_config"] = {k: raw["text_config"][k] for k in kept}  # rms_norm_eps, rope bases, ...: defaults
    (folder / "config.json").write_text(json.dumps(raw))
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in weights.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    ours, config, _ = load_model(str(folder), torch.float32, torch.device("cpu"))
    assert config.rms_norm_eps == 1e-6 and config.hidden_activation == "gelu_pytorch_tanh"
    h = Harness(ours)
    seq = h.new_seq(_prompt(9, 4))
    (logits,) = h.step([(seq, 9)])
    assert_rows_match(hf, seq, logits)
