"""Steps that read a GGUF's quantized blocks (models/gguf_weights.py) compute what the fp32 weights compute."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conveyor.kernels import gguf
from conveyor.serving import LLM, SamplingParams
from conveyor.serving.config import EngineConfig
from conveyor.serving.models.cpu_packing import Bfloat16PackedLinear, PackedLinear, packable_dtypes
from conveyor.serving.models.gguf_weights import (
    BFLOAT16_BLOCKS_MAX_ROWS,
    BFLOAT16_PREFILL_MAX_ROWS,
    GGUFLinear,
    default_gguf_max_rows,
    hf_name,
    load_blocks,
)
from tests.cpu_ext_gate import require_cpu_ext

require_cpu_ext("gguf_linear")

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 7, 120, 33, 2, 9], [11, 12, 13], [5, 17, 99, 3, 42, 8, 61, 7, 120, 33, 2, 9, 50],
           list(range(40, 75))]
NUM_TOKENS = [20, 31, 17, 12]


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_kv_blocks=256),
    # chunked prefill, preemption (recompute) and prefix hits, all in steps small enough for the blocks
    dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=8, max_num_seqs=4),
], ids=["default", "chunked-preempting"])
def test_greedy_tokens_equal_the_fp32_path(quantized_dir, engine_kwargs):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in NUM_TOKENS]
    fp32 = LLM(str(quantized_dir), gguf_max_rows=0, **engine_kwargs)
    assert fp32.engine.num_gguf_linears == 0
    blocks = LLM(str(quantized_dir), gguf_max_rows=8, **engine_kwargs)
    assert blocks.engine.num_gguf_linears == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the LM head
    expected = [r.token_ids for r in fp32.generate(PROMPTS, params)]
    assert [r.token_ids for r in blocks.generate(PROMPTS, params)] == expected
    if engine_kwargs["num_kv_blocks"] == 12:
        assert blocks.engine.scheduler.num_preemptions_total > 0
        assert blocks.engine.kv_cache.num_prefix_hits > 0


def test_small_steps_use_the_blocks_and_large_ones_the_fp32_weights(quantized_dir, monkeypatch):
    llm = LLM(str(quantized_dir), gguf_max_rows=4, num_kv_blocks=64)
    layer = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, GGUFLinear)
    dense_rows = []
    dense = layer.dense
    forward = dense.forward
    monkeypatch.setattr(dense, "forward", lambda x: dense_rows.append(x.shape[0]) or forward(x))
    x = torch.randn(5, dense.in_features)
    layer(x)
    assert dense_rows == [5]
    small = layer(x[:4])
    assert dense_rows == [5]
    expected = x[:4] @ layer.weight.dequantize().T
    torch.testing.assert_close(small, expected, atol=1e-4, rtol=1e-5)


def test_models_without_blocks_or_off_the_cpu_use_fp32(tiny_model_dir):
    assert LLM(str(tiny_model_dir), num_kv_blocks=64).engine.num_gguf_linears == 0
    with pytest.raises(ValueError, match="gguf_max_rows"):
        LLM(str(tiny_model_dir), gguf_max_rows=-1)


def test_gguf_names_map_to_transformers_names():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.0.attn_norm.weight") is None


@pytest.mark.slow
def test_smollm2_blocks_dequantize_to_its_fp32_weights_exactly():
    """The converted SmolLM2 keeps its GGUF blocks, q/k rows un-permuted as transformers does for fp32."""
    from conveyor.serving.models.loader import resolve_model_path

    try:
        model_dir = resolve_model_path("smollm2")
    except Exception as exc:  # no registry reachable: the only reason this may be skipped
        pytest.skip(f"SmolLM2 is not available: {exc}")
    blocks = load_blocks(model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    assert len(blocks) == 30 * 7 + 1  # every layer's seven projections, and the (tied) embedding
    for name, (rows, ggml_type) in blocks.items():
        assert torch.equal(gguf.dequantize(rows, ggml_type, weights[name].shape[1]), weights[name]), name


def test_default_threshold_follows_the_cpu(quantized_dir, monkeypatch):
    """gguf_max_rows unset: 64 rows where the kernels run AVX-512 or AVX2, 8 on the portable build."""
    llm = LLM(str(quantized_dir), num_kv_blocks=64)
    assert llm.engine.gguf_max_rows == gguf.default_max_rows()
    assert llm.engine.model.model.layers[0].self_attn.qkv_proj.max_rows == gguf.default_max_rows()
    for capability, rows in (("AVX512", 64), ("AVX2", 64), ("DEFAULT", 8)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert gguf.default_max_rows() == rows


native_bf16 = pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(),
                                 reason="bf16 is not native on this CPU (no AVX512-BF16 or AMX)")


@native_bf16
def test_bfloat16_prefill_multiplies_large_steps_in_bf16_and_small_ones_by_the_blocks(quantized_dir):
    fp32 = LLM(str(quantized_dir), gguf_max_rows=4, num_kv_blocks=64)
    bf16 = LLM(str(quantized_dir), gguf_max_rows=4, num_kv_blocks=64, cpu_prefill_dtype="bfloat16")
    want, got = (llm.engine.model.model.layers[0].mlp.gate_up_proj for llm in (fp32, bf16))
    assert isinstance(got.dense, Bfloat16PackedLinear) and type(want.dense) is PackedLinear
    head = bf16.engine.model.lm_head or bf16.engine.model.packed_logits
    assert isinstance(head, GGUFLinear) and type(head.dense) is PackedLinear  # the LM head keeps fp32
    x = torch.randn(9, got.dense.in_features)
    torch.testing.assert_close(got(x[:4]), want(x[:4]), atol=0, rtol=0)  # small steps: the same blocks kernel
    weight = got.weight.dequantize()
    expected = (x.bfloat16().float() @ weight.bfloat16().float().T)  # both operands rounded, fp32 sums
    torch.testing.assert_close(got(x), expected, atol=2e-2, rtol=1e-2)
    assert (got(x) - want(x)).abs().max() > 0  # really rounded: not the fp32 product


@native_bf16
def test_bfloat16_prefill_leaves_steps_within_max_rows_bit_identical(quantized_dir):
    """Only steps past gguf_max_rows change: a short prompt alone decodes exactly as in fp32, and prefill-heavy
    batches still generate every token (a random model's near-ties make their tokens no yardstick: the quality
    on SmolLM2 is benchmarks/kv_cache_quality.py --prefill-dtypes bfloat16)."""
    fp32, bf16 = (LLM(str(quantized_dir), gguf_max_rows=4, num_kv_blocks=256, cpu_prefill_dtype=d)
                  for d in ("float32", "bfloat16"))
    short = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert bf16.generate([[11, 12, 13]], short)[0].token_ids == fp32.generate([[11, 12, 13]], short)[0].token_ids
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in NUM_TOKENS]
    assert [len(r.token_ids) for r in bf16.generate(PROMPTS, params)] == NUM_TOKENS


def test_bfloat16_prefill_needs_gguf_blocks_and_a_known_dtype(tiny_model_dir, quantized_dir):
    with pytest.raises(ValueError, match="cpu_prefill_dtype"):
        LLM(str(quantized_dir), cpu_prefill_dtype="float16")
    if torch.bfloat16 in packable_dtypes():
        with pytest.raises(ValueError, match="reads no GGUF blocks"):
            LLM(str(tiny_model_dir), num_kv_blocks=64, cpu_prefill_dtype="bfloat16")
    else:
        with pytest.raises(ValueError, match="AVX512-BF16"):
            LLM(str(quantized_dir), num_kv_blocks=64, cpu_prefill_dtype="bfloat16")


def test_bfloat16_prefill_moves_the_default_threshold_to_its_crossover():
    crossover = BFLOAT16_BLOCKS_MAX_ROWS if gguf.has_bf16_kernel() else BFLOAT16_PREFILL_MAX_ROWS
    assert default_gguf_max_rows(EngineConfig(cpu_prefill_dtype="bfloat16")) == crossover
    assert default_gguf_max_rows(EngineConfig()) == gguf.default_max_rows()


@pytest.mark.skipif(not gguf.has_bf16_kernel(), reason="no AVX512-BF16: no bf16 blocks kernel here")
def test_bfloat16_mode_multiplies_mid_sized_steps_over_the_blocks_in_bf16(quantized_dir):
    """From gguf.BF16_MIN_ROWS rows up to max_rows every layer linear and the LM head take the bf16 blocks kernel:
    the blocks' quants, bf16 products."""
    bf16 = LLM(str(quantized_dir), gguf_max_rows=32, num_kv_blocks=64, cpu_prefill_dtype="bfloat16")
    head = bf16.engine.model.lm_head or bf16.engine.model.packed_logits
    for linear in (bf16.engine.model.model.layers[0].mlp.gate_up_proj, head):
        assert linear.bf16_min_rows == gguf.BF16_MIN_ROWS
        x = torch.randn(gguf.BF16_MIN_ROWS + 1, linear.weight.in_features)
        weight = linear.weight.dequantize()
        torch.testing.assert_close(linear(x), x.bfloat16().float() @ weight.bfloat16().float().T, atol=1e-4, rtol=1e-5)
        small = x[:gguf.BF16_MIN_ROWS - 1]
        torch.testing.assert_close(linear(small), gguf.gguf_linear(small, linear.weight), atol=0, rtol=0)


@native_bf16
def test_a_bfloat16_packed_linear_rounds_its_operands_and_adds_the_bias_in_fp32():
    weight, bias, x = torch.randn(48, 64), torch.randn(48), torch.randn(2, 5, 64)
    got = Bfloat16PackedLinear(weight, bias)(x)
    assert got.dtype == torch.float32 and got.shape == (2, 5, 48)
    expected = x.bfloat16().float() @ weight.bfloat16().float().T + bias
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
