"""Gemma 2, Gemma 3 (text), Phi-3 and Phi-4-mini against transformers: per-step logits through prefill, chunked prefill,
decodes and packed mixed steps, on prompts longer than the sliding window; their layer variants (Gemma's
RMSNorm, YaRN and LongRoPE inverse frequencies) against transformers' own functions.

Tolerances: float32 logits within 1e-4 of transformers' (ATOL of tests/serving/test_model.py; summation order is
all that differs); bfloat16 logits within 1.5x (+0.01) the distance of transformers' own bfloat16 run from the
float32 truth (measured: 0.03-0.12 for both; Gemma's logits reach 1-7, where one bf16 step is 0.008-0.03).
"""
from __future__ import annotations

import pytest
import torch

from conveyor.serving.models.gemma import FULL, SLIDING, layer_types
from conveyor.serving.models.loader import load_model
from tests.cpu_ext_gate import require_cpu_ext
from tests.serving.test_model import TINY, Harness, _prompt, assert_rows_match, build_variant, hf_logits

WINDOW = 4  # every test sequence (5-13 tokens) outgrows it
HEAD_DIM = TINY["head_dim"]
VARIANTS = {
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, query_pre_attn_scalar=32, attn_logit_softcapping=0.5,
                                    final_logit_softcapping=1.0)),
    "gemma3": ("Gemma3TextConfig", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=32, layer_types=[SLIDING, FULL],
        rope_parameters={SLIDING: dict(rope_type="default", rope_theta=100.0),
                         FULL: dict(rope_type="linear", factor=2.0, rope_theta=1e6)})),
    # Phi-3.5's LongRoPE with an original context of 4 (< every test sequence): transformers uses the long factors
    # throughout, as we do
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW, original_max_position_embeddings=4, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.3 * i for i in range(HEAD_DIM // 2)],
        long_factor=[2.0 + 0.7 * i for i in range(HEAD_DIM // 2)]))),
    # Phi-4-mini: the same class rotating only the first 3/4 of each head (12 of 16 dims; LongRoPE's factors
    # cover those), tied embeddings
    "phi4-mini": ("Phi3Config", dict(tie_word_embeddings=True, original_max_position_embeddings=4,
                                     partial_rotary_factor=0.75, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.3 * i for i in range(6)],
        long_factor=[2.0 + 0.7 * i for i in range(6)]))),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    """(our model, transformers model, path) for one tiny random checkpoint."""
    return build_variant(tmp_path_factory.mktemp(request.param), *VARIANTS[request.param])


def test_chunked_prefill_then_decode_past_the_window(tiny):
    ours, hf, _ = tiny
    h = Harness(ours)
    seq = h.new_seq(_prompt(13, 1))
    for chunk in (6, 7):  # the second chunk reads cached keys, some of them out of the local layers' window
        (logits,) = h.step([(seq, chunk)])
        assert_rows_match(hf, seq, logits)
    for _ in range(4):
        seq.tokens.append(int(logits[-1].argmax()))
        (logits,) = h.step([(seq, 1)])
        assert_rows_match(hf, seq, logits)


def test_packed_mixed_batch(tiny):
    ours, hf, _ = tiny
    h = Harness(ours)
    a, b, c = h.new_seq(_prompt(9, 2)), h.new_seq(_prompt(5, 3)), h.new_seq(_prompt(7, 4))
    h.step([(b, 5), (c, 7)])
    b.tokens.append(5)
    c.tokens.append(6)
    out_b, out_a, out_c = h.step([(b, 1), (a, 9), (c, 1)])
    for seq, logits in ((a, out_a), (b, out_b), (c, out_c)):
        assert_rows_match(hf, seq, logits)


def test_cpu_backend_and_its_fused_ops(tiny):
    """The "cpu" backend: fused rope (and norms / SiLU where the family's match transformers'), decode-only and
    mixed steps."""
    require_cpu_ext()
    _, hf, path = tiny
    ours, _, _ = load_model(str(path), torch.float32, torch.device("cpu"), attention_backend="cpu")
    assert ours.model.fused
    h = Harness(ours)
    b, c = h.new_seq(_prompt(5, 3)), h.new_seq(_prompt(9, 1))
    h.step([(b, 5), (c, 9)])
    for token in (5, 6):
        b.tokens.append(token)
        c.tokens.append(token + 1)
        out_b, out_c = h.step([(b, 1), (c, 1)])
        assert_rows_match(hf, b, out_b)
        assert_rows_match(hf, c, out_c)


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(tiny):
    _, hf32, path = tiny
    ours, _, _ = load_model(str(path), torch.bfloat16, torch.device("cpu"))
    hf = type(hf32)(hf32.config).eval()
    hf.load_state_dict(hf32.state_dict())
    hf = hf.to(torch.bfloat16)
    h = Harness(ours, dtype=torch.bfloat16)
    seq = h.new_seq(_prompt(11, 1))
    (logits,) = h.step([(seq, 11)])
    truth = hf_logits(hf32, seq.tokens)
    their_error = (hf_logits(hf, seq.tokens) - truth).abs().max()
    assert (logits - truth).abs().max() <= 1.5 * their_error + 0.01


def test_the_window_and_caps_matter(tiny):
    """The options reach attention: without them the logits move well past the tolerance (so the tests above
    would catch a dropped option)."""
    ours, hf, _ = tiny
    attn = [layer.self_attn.attn for layer in ours.model.layers]
    if not any(a.sliding_window for a in attn):
        pytest.skip("no sliding window in this variant")
    saved = [(a.sliding_window, a.logits_soft_cap) for a in attn]
    try:
        for a in attn:
            a.sliding_window = a.logits_soft_cap = None
        h = Harness(ours)
        seq = h.new_seq(_prompt(11, 1))
        (logits,) = h.step([(seq, 11)])
        assert (logits - hf_logits(hf, seq.tokens)).abs().max() > 1e-2
    finally:
        for a, (window, cap) in zip(attn, saved, strict=True):
            a.sliding_window, a.logits_soft_cap = window, cap


def test_gemma_rms_norm_matches_transformers_in_bfloat16():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from conveyor.serving.models.layers import GemmaRMSNorm

    theirs, ours = Gemma2RMSNorm(64, eps=1e-6), GemmaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(64))
        ours.weight.copy_(theirs.weight)
    theirs, ours = theirs.to(torch.bfloat16), ours.to(torch.bfloat16)
    x, residual = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(ours(x), theirs(x))
    normed, summed = ours(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(normed, theirs(x + residual))


def test_layer_types_of_configs_without_them():
    from types import SimpleNamespace

    gemma2 = SimpleNamespace(model_type="gemma2", num_hidden_layers=4)
    assert layer_types(gemma2) == [SLIDING, FULL, SLIDING, FULL]
    gemma3 = SimpleNamespace(model_type="gemma3_text", num_hidden_layers=7, sliding_window_pattern=3)
    assert layer_types(gemma3) == [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL, SLIDING]
    with pytest.raises(ValueError, match="layer_types"):
        layer_types(SimpleNamespace(model_type="gemma2", num_hidden_layers=2, layer_types=["chunked", FULL]))


def test_gemma3_rope_of_an_older_config():
    """Configs before transformers 5: rope_theta (+ rope_scaling) for global layers, rope_local_base_freq for local
    ones; the tables match transformers' for the same model."""
    from transformers import PreTrainedConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from conveyor.serving.models.gemma import GemmaModel

    old = dict(TINY, model_type="gemma3_text", rope_theta=1e6, rope_local_base_freq=100.0, sliding_window=WINDOW,
               rope_scaling=dict(rope_type="linear", factor=8.0), query_pre_attn_scalar=16,
               layer_types=[SLIDING, FULL])
    ours = GemmaModel(PreTrainedConfig.from_dict(old), "torch")
    from transformers import Gemma3TextConfig

    theirs = Gemma3RotaryEmbedding(Gemma3TextConfig(**{k: v for k, v in old.items() if k != "model_type"}))
    positions = torch.arange(20)
    x = torch.zeros(1, 20, HEAD_DIM)
    for kind, table in ((FULL, ours.rotary_emb), (SLIDING, ours.local_rotary_emb)):
        cos, _ = theirs(x, positions[None], kind)
        torch.testing.assert_close(table(positions, torch.float32)[0].squeeze(1), cos[0, :, :HEAD_DIM // 2])


@pytest.mark.parametrize("params, seq_len", [
    (dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32), None),
    (dict(rope_type="yarn", rope_theta=500000.0, factor=8.0, original_max_position_embeddings=16, beta_fast=16,
          beta_slow=2, mscale=0.707, mscale_all_dim=0.707), None),
    (dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, attention_factor=1.5, truncate=False), None),
    (dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + i / 8 for i in range(8)],
          long_factor=[3.0 + i for i in range(8)], original_max_position_embeddings=32), 33),
], ids=["yarn", "yarn-mscale", "yarn-attention-factor", "longrope"])
def test_rope_variants_match_transformers(params, seq_len):
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from conveyor.serving.models.rotary import ROPE_TABLE_SCALE, rope_inv_freq, rope_parameters

    config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_parameters=dict(params))
    inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, seq_len=seq_len)
    torch.testing.assert_close(rope_inv_freq(config), inv_freq, atol=0, rtol=1e-6)
    assert ROPE_TABLE_SCALE[params["rope_type"]](rope_parameters(config), config) == pytest.approx(scale)


def test_longrope_short_factors_where_the_context_is_the_original_one():
    """A model served within its pretraining context (max_position_embeddings == original) keeps the short
    factors and no attention scaling, as transformers does below the threshold."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from conveyor.serving.models.phi3 import phi3_rope_parameters
    from conveyor.serving.models.rotary import RotaryEmbedding, rope_inv_freq

    factors = dict(short_factor=[1.0 + i / 8 for i in range(8)], long_factor=[3.0 + i for i in range(8)])
    config = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=32,
                        original_max_position_embeddings=32, rope_scaling=dict(type="su", **factors))
    inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](config)
    params = phi3_rope_parameters(config)
    torch.testing.assert_close(rope_inv_freq(config, params), inv_freq, atol=0, rtol=1e-6)
    assert scale == 1.0 and RotaryEmbedding(config, params).cos[0, 0] == 1.0


def test_what_the_fast_cpu_paths_say(tiny):
    from conveyor.serving.models.decode_stack import unavailable_reason
    from conveyor.serving.models.gguf_weights import attach_gguf_weights

    ours, _, _ = tiny
    assert attach_gguf_weights(ours, {}) == 0  # no llama.cpp layout mapped: logged, nothing attached
    ours.model.fused = True  # as the "cpu" backend sets it: the family is what rules the C++ loop out
    try:
        reason = unavailable_reason(ours)
        assert reason is not None and any(
            why in reason for why in ("decoder layer", "sliding window", "partial_rotary_factor", "did not build"))
    finally:
        ours.model.fused = False

# Gemma 2's chat template as Google ships it (role checks verbatim); Gemma 3's folds a system prompt into the
# first user turn instead.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}{%- set role = 'model' if message['role'] == 'assistant' "
    "else message['role'] -%}{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}<end_of_turn>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")


def test_chat_templates_without_a_system_role(tiny_model_dir):
    """A system message with Gemma 2's template: transformers raises TemplateError, so the request is the client's
    error (ValueError, which the replica answers with 400 invalid_request); Gemma 3's template takes it."""
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    from conveyor.serving.detokenizer import apply_chat_template

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tokenizer.chat_template = GEMMA2_TEMPLATE
    with pytest.raises(TemplateError, match="System role not supported"):
        tokenizer.apply_chat_template(system, add_generation_prompt=True, tokenize=False)
    with pytest.raises(ValueError, match="refused these messages: System role not supported"):
        apply_chat_template(tokenizer, system)
    assert apply_chat_template(tokenizer, system[1:]).endswith("<start_of_turn>user\nHi<end_of_turn>\n"
                                                               "<start_of_turn>model\n")
    tokenizer.chat_template = GEMMA3_TEMPLATE
    assert "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>" in apply_chat_template(tokenizer, system)
