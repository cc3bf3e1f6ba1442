"""Rotary choices that depend on the family and on the served context, against transformers' own models:
partial_rotary_factor (honoured by Phi-3's class, as Phi-4-mini uses it; ignored by Llama and Qwen, whose
rotaries rotate whole heads) and LongRoPE's short or long factors, picked by --max-model-len.

LongRoPE: transformers picks per forward, by the sequence's length (long past original_max_position_embeddings);
Conveyor picks once, by the served context (long when max_model_len exceeds the original context, as vLLM does),
so both agree on every sequence within the original context when max_model_len does not exceed it, and on every
sequence past it when max_model_len does. Per-step logits within ATOL of transformers' (float32), greedy tokens
equal through the engine.
"""
from __future__ import annotations

import json

import pytest
import torch

from conveyor.serving import LLM, SamplingParams
from conveyor.serving.models.loader import load_model
from tests.serving.test_model import TINY, Harness, _prompt, assert_rows_match, build_variant

HALF = TINY["head_dim"] // 2
ORIGINAL = 8  # LongRoPE's pretraining context in these tests
LONGROPE = ("Phi3Config", dict(original_max_position_embeddings=ORIGINAL, rope_parameters=dict(
    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.3 * i for i in range(HALF)],
    long_factor=[2.0 + 0.7 * i for i in range(HALF)])))


@pytest.mark.parametrize("config_cls", ["LlamaConfig", "Qwen3Config"])
def test_llama_and_qwen_rotate_whole_heads_whatever_partial_rotary_factor_says(config_cls, tmp_path):
    ours, hf, _ = build_variant(tmp_path, config_cls, dict(partial_rotary_factor=0.5))
    assert ours.config.rope_parameters["partial_rotary_factor"] == 0.5
    assert ours.model.rotary_emb.cos.shape[-1] == HALF
    h = Harness(ours)
    seq = h.new_seq(_prompt(9, 1))
    (logits,) = h.step([(seq, 9)])
    assert_rows_match(hf, seq, logits)
    seq.tokens.append(int(logits[-1].argmax()))
    (logits,) = h.step([(seq, 1)])
    assert_rows_match(hf, seq, logits)


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    """(transformers model, path) of a tiny Phi-3 with LongRoPE: original context 8, max_position_embeddings 128."""
    _, hf, path = build_variant(tmp_path_factory.mktemp("longrope"), *LONGROPE)
    return hf, path


def _load(path, max_model_len: int | None):
    ours, _, _ = load_model(str(path), torch.float32, torch.device("cpu"), max_model_len=max_model_len)
    return ours


def test_short_factors_when_the_served_context_is_the_original_one(longrope):
    """--max-model-len 8: every sequence fits the original context, where transformers rotates short."""
    hf, path = longrope
    ours = _load(path, ORIGINAL)
    h = Harness(ours)
    seq = h.new_seq(_prompt(5, 2))
    (logits,) = h.step([(seq, 5)])
    assert_rows_match(hf, seq, logits)
    for _ in range(ORIGINAL - 5):
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = h.step([(seq, 1)])
        assert_rows_match(hf, seq, logits)


@pytest.mark.parametrize("max_model_len", [None, 64])
def test_long_factors_when_the_served_context_is_longer(longrope, max_model_len):
    """The model's own context (128) or --max-model-len 64: long factors, as transformers rotates a sequence past
    the original context."""
    hf, path = longrope
    h = Harness(_load(path, max_model_len))
    seq = h.new_seq(_prompt(ORIGINAL + 3, 3))
    (logits,) = h.step([(seq, ORIGINAL + 3)])
    assert_rows_match(hf, seq, logits)
    for _ in range(3):
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = h.step([(seq, 1)])
        assert_rows_match(hf, seq, logits)


def test_the_choice_changes_the_rotation(longrope):
    """The two sides differ (so the tests above would catch a --max-model-len that never reaches the rope)."""
    _, path = longrope
    short, long = _load(path, ORIGINAL).model.rotary_emb, _load(path, ORIGINAL + 1).model.rotary_emb
    assert (short.cos[1:ORIGINAL] - long.cos[1:ORIGINAL]).abs().max() > 0.1
    assert short.params["max_model_len"] == ORIGINAL and _load(path, 10_000).model.rotary_emb.params[
        "max_model_len"] == 128  # clipped to the model's own context, as the engine clips it


def _hf_greedy(hf, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(num_tokens):
            ids = torch.cat([ids, hf(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("max_model_len, prompt_len, num_tokens", [(ORIGINAL, 3, 5), (64, ORIGINAL + 2, 6)],
                         ids=["short", "long"])
def test_engine_greedy_tokens_on_both_sides(longrope, max_model_len, prompt_len, num_tokens):
    """Through the engine (--max-model-len as LLM's max_model_len): transformers' greedy tokens, every one
    computed over a sequence on the same side of the original context as the served context."""
    hf, path = longrope
    llm = LLM(str(path), max_model_len=max_model_len, num_kv_blocks=32, block_size=4, max_num_batched_tokens=4)
    prompts = [_prompt(prompt_len, seed) for seed in (4, 5)]
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    got = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
    assert got == [_hf_greedy(hf, p, num_tokens) for p in prompts]



def _hub_config(tmp_path, raw: dict):
    """config.json as a transformers-4 checkpoint holds it (scaled rope in rope_scaling), read as the engine reads
    it: a plain config there fails to standardize the rope (no max_position_embeddings yet), so its class reads it."""
    from conveyor.serving.models.loader import read_config

    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, **raw), sort_keys=True))
    return read_config(tmp_path)


def test_phi4_mini_config_as_the_hub_holds_it(tmp_path):
    """partial_rotary_factor at the top level, LongRoPE as rope_scaling {type: longrope}: our tables equal
    transformers' Phi3RotaryEmbedding on both sides of the original context."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from conveyor.serving.models.phi3 import Phi3ForCausalLM

    rotary_half = 6  # 0.75 of head_dim 16 rotates 12 dims
    config = _hub_config(tmp_path, dict(
        model_type="phi3", architectures=["Phi3ForCausalLM"], rope_theta=10000.0, partial_rotary_factor=0.75,
        sliding_window=262144, tie_word_embeddings=True, original_max_position_embeddings=ORIGINAL,
        rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.2 * i for i in range(rotary_half)],
                          long_factor=[1.5 + 0.9 * i for i in range(rotary_half)])))
    theirs = Phi3RotaryEmbedding(config)
    x, positions = torch.zeros(1, 1, TINY["head_dim"]), torch.arange(20)
    for served, seq_len in ((ORIGINAL, ORIGINAL), (None, 20)):
        ours = Phi3ForCausalLM(config).model.rotary_emb
        ours.reset_tables(served)
        cos, _ = theirs(x, positions[None, :seq_len])
        assert ours.rotary_dim == 2 * rotary_half
        torch.testing.assert_close(ours(positions[:seq_len], torch.float32)[0].squeeze(1), cos[0, :, :rotary_half])


@pytest.mark.parametrize("model_type, rope_scaling", [
    ("llama", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)),
    ("qwen2", dict(type="yarn", factor=4.0, original_max_position_embeddings=32)),
], ids=["llama3.1", "qwen-yarn"])
def test_scaled_rope_in_rope_scaling(tmp_path, model_type, rope_scaling):
    """Llama 3.1's and Qwen2.5's YaRN config.json load, and rotate as transformers' model of that config."""
    from transformers import AutoModelForCausalLM

    from conveyor.serving.models.llama import LlamaModel

    config = _hub_config(tmp_path, dict(model_type=model_type, rope_theta=500000.0, rope_scaling=rope_scaling,
                                        tie_word_embeddings=False, architectures=None))
    theirs = AutoModelForCausalLM.from_config(config).model.rotary_emb
    positions = torch.arange(40)
    cos, _ = theirs(torch.zeros(1, 1, TINY["head_dim"]), positions[None])
    torch.testing.assert_close(LlamaModel(config, "torch").rotary_emb(positions, torch.float32)[0].squeeze(1),
                               cos[0, :, :HALF])
