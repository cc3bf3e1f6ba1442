"""cpu_prefill_dtype int8 (models/gguf_weights.py multiply_in_int8): every step past the rows kernel multiplies the
GGUF quants by int8-rounded activations, in the modules and in the decode stack alike."""
from __future__ import annotations

import pytest
import torch

from conveyor.kernels import gguf
from conveyor.serving import LLM, SamplingParams
from conveyor.serving.config import EngineConfig
from conveyor.serving.models.gguf_weights import INT8_MAX_ROWS, GGUFLinear, default_gguf_max_rows
from tests.cpu_ext_gate import require_cpu_ext
from tests.serving.test_decode_stack import check_against_the_module_path

require_cpu_ext("gguf_linear")

int8_kernel = pytest.mark.skipif(not gguf.has_int8_kernel(), reason="no AVX512-VNNI nor AVX2: no int8 kernel here")


@int8_kernel
def test_int8_mode_multiplies_every_step_past_the_rows_kernel_in_int8(quantized_dir):
    fp32 = LLM(str(quantized_dir), num_kv_blocks=64)
    int8 = LLM(str(quantized_dir), num_kv_blocks=64, cpu_prefill_dtype="int8")
    model = int8.engine.model
    head = model.lm_head or model.packed_logits
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert head in linears and len(linears) == int8.engine.num_gguf_linears
    assert all(m.int8_weight is not None and m.max_rows == INT8_MAX_ROWS and m.dense is None for m in linears)
    want = fp32.engine.model.model.layers[0].mlp.gate_up_proj
    for linear in (model.model.layers[0].mlp.gate_up_proj, head):
        small_rows = gguf.ROWS_KERNEL_MAX_ROWS[linear.ggml_type]
        x = torch.randn(300, linear.weight.in_features)  # past the old max_rows and the kernel's 48-row sweeps
        expected = gguf.int8_linear_reference(x, linear.weight.dequantize())
        torch.testing.assert_close(linear(x), expected, atol=1e-4, rtol=1e-5)
        small = x[:small_rows]
        torch.testing.assert_close(linear(small), gguf.gguf_linear(small, linear.weight), atol=0, rtol=0)
    x = torch.randn(2, want.weight.in_features)
    torch.testing.assert_close(model.model.layers[0].mlp.gate_up_proj(x), want(x), atol=0, rtol=0)


@int8_kernel
def test_int8_decode_steps_equal_the_module_path(quantized_dir, monkeypatch):
    llm = LLM(str(quantized_dir), num_kv_blocks=256, cpu_prefill_dtype="int8")
    stack = llm.engine.model.decode_stack
    assert stack.int8_activations and stack.max_rows == INT8_MAX_ROWS
    steps = check_against_the_module_path(llm.engine.model, monkeypatch)
    prompts = [[5 + i, 17, 99 + i, 3] for i in range(9)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert [len(r.token_ids) for r in llm.generate(prompts, params)] == [6] * len(prompts)
    assert max(steps) == 9, steps


@int8_kernel
def test_int8_mode_leaves_the_smallest_steps_bit_identical(quantized_dir):
    """A lone request of 3 tokens never passes the rows kernel, its prefill (3 rows) nor its decodes: the same tokens.
    (Larger steps round, so a random model's near-ties make their tokens no yardstick: the quality on SmolLM2 is
    benchmarks/kv_cache_quality.py.)"""
    fp32, int8 = (LLM(str(quantized_dir), num_kv_blocks=256, cpu_prefill_dtype=d) for d in ("float32", "int8"))
    short = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    assert int8.generate([[11, 12, 13]], short)[0].token_ids == fp32.generate([[11, 12, 13]], short)[0].token_ids


def test_int8_mode_needs_gguf_blocks_and_the_kernel(tiny_model_dir, quantized_dir):
    assert default_gguf_max_rows(EngineConfig(cpu_prefill_dtype="int8")) == INT8_MAX_ROWS
    if gguf.has_int8_kernel():
        with pytest.raises(ValueError, match="reads no GGUF blocks"):
            LLM(str(tiny_model_dir), num_kv_blocks=64, cpu_prefill_dtype="int8")
    else:
        with pytest.raises(ValueError, match="AVX512-VNNI or AVX2"):
            LLM(str(quantized_dir), num_kv_blocks=64, cpu_prefill_dtype="int8")
