"""A decode step's layers in one C++ call (models/decode_stack.py) give the module path's hidden states, bit for bit,
and run only where they apply."""
from __future__ import annotations

import pytest
import torch

from conveyor.kernels import gguf
from conveyor.serving import LLM, SamplingParams
from conveyor.serving.models.decode_stack import unavailable_reason
from tests.cpu_ext_gate import require_cpu_ext

require_cpu_ext("decode_layers")

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 7, 120, 33, 2, 9], [11, 12, 13], [5, 17, 99, 3, 42, 8, 61, 7, 120, 33, 2, 9, 50],
           list(range(40, 75)), [7, 7, 7, 7, 7]]
NUM_TOKENS = [20, 31, 17, 12, 25]


def check_against_the_module_path(model, monkeypatch) -> dict[int, int]:
    """Every step the stack runs is run again through the modules, on the same inputs and (identically rewritten)
    caches, and must give equal hidden states. Returns how many stack steps ran, by rows."""
    stack = model.decode_stack
    forward = model.forward
    steps: dict[int, int] = {}

    def checked(input_ids, positions, kv_caches, meta):
        hidden = forward(input_ids, positions, kv_caches, meta)
        if stack.handles(input_ids.shape[0], meta):
            model.decode_stack = None
            try:
                expected = forward(input_ids, positions, kv_caches, meta)
            finally:
                model.decode_stack = stack
            assert torch.equal(hidden, expected), (hidden - expected).abs().max()
            steps[input_ids.shape[0]] = steps.get(input_ids.shape[0], 0) + 1
        return hidden

    monkeypatch.setattr(model, "forward", checked)
    return steps


@pytest.mark.parametrize("engine_kwargs", [
    dict(num_kv_blocks=256),
    dict(num_kv_blocks=256, kv_cache_dtype="bfloat16"),
    # chunked prefill, preemption and prefix hits: mixed steps go through the modules, decode steps through C++
    dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=8, max_num_seqs=4),
], ids=["default", "bf16-cache", "chunked-preempting"])
def test_decode_steps_equal_the_module_path(quantized_dir, engine_kwargs, monkeypatch):
    llm = LLM(str(quantized_dir), gguf_max_rows=8, **engine_kwargs)
    model = llm.engine.model
    assert model.decode_stack is not None
    steps = check_against_the_module_path(model, monkeypatch)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in NUM_TOKENS]
    results = llm.generate(PROMPTS, params)
    assert [len(r.token_ids) for r in results] == NUM_TOKENS
    if engine_kwargs["num_kv_blocks"] == 12:
        assert steps and llm.engine.scheduler.num_preemptions_total > 0
    else:  # 1-3 rows take GGUF's rows of blocks, 4-5 the interleaved layout (conveyor/kernels/gguf.py): both ran
        assert min(steps) <= 3 and max(steps) >= 4, steps


@pytest.mark.skipif(not gguf.has_bf16_kernel(), reason="no AVX512-BF16: the blocks have no bf16 kernel here")
def test_bfloat16_decode_steps_equal_the_module_path(quantized_dir, monkeypatch):
    """cpu_prefill_dtype bfloat16: decode steps from gguf.BF16_MIN_ROWS rows take the bf16 blocks kernel, in the
    stack as in the modules."""
    llm = LLM(str(quantized_dir), gguf_max_rows=16, num_kv_blocks=256, cpu_prefill_dtype="bfloat16")
    model = llm.engine.model
    assert model.decode_stack.bf16_min_rows == gguf.BF16_MIN_ROWS
    steps = check_against_the_module_path(model, monkeypatch)
    prompts = [[5 + i, 17, 99 + i, 3] for i in range(gguf.BF16_MIN_ROWS + 2)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert [len(r.token_ids) for r in llm.generate(prompts, params)] == [6] * len(prompts)
    assert max(steps) >= gguf.BF16_MIN_ROWS, steps


def test_tokens_are_those_of_the_module_path(quantized_dir):
    params = [SamplingParams(max_tokens=n, temperature=0.8, seed=i) for i, n in enumerate(NUM_TOKENS)]
    with_stack = LLM(str(quantized_dir), gguf_max_rows=8, num_kv_blocks=256)
    without = LLM(str(quantized_dir), gguf_max_rows=8, num_kv_blocks=256, cpu_decode_stack=False)
    assert without.engine.model.decode_stack is None
    assert [r.token_ids for r in with_stack.generate(PROMPTS, params)] == \
        [r.token_ids for r in without.generate(PROMPTS, params)]


def test_steps_larger_than_the_blocks_take_the_modules(quantized_dir, monkeypatch):
    llm = LLM(str(quantized_dir), gguf_max_rows=2, num_kv_blocks=256)
    steps = check_against_the_module_path(llm.engine.model, monkeypatch)
    llm.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in NUM_TOKENS])
    # the longest requests' last steps have 1-2 rows; every step before them, more
    assert steps and max(steps) <= 2, steps


def test_the_stack_is_off_where_it_cannot_apply(tiny_model_dir, quantized_dir):
    plain = LLM(str(tiny_model_dir), num_kv_blocks=64).engine.model
    assert plain.decode_stack is None
    assert "not in GGUF blocks" in unavailable_reason(plain)
    assert LLM(str(quantized_dir), gguf_max_rows=0, num_kv_blocks=64).engine.model.decode_stack is None
    torch_backend = LLM(str(quantized_dir), attention_backend="torch", num_kv_blocks=64).engine.model
    assert torch_backend.decode_stack is None
    assert "attention backend" in unavailable_reason(torch_backend)


def test_the_op_rejects_inconsistent_layer_lists():
    x = torch.zeros(1, 64)
    empty = torch.zeros(0)
    with pytest.raises(RuntimeError, match="layers need 14 weights"):
        torch.ops.conveyor_cpu.decode_layers(x, [empty], [3, 3, 3, 3], [empty], [empty], empty, empty, empty,
                                             empty, empty, empty, 4, 2, 16, 1e-5, 0.25, 3, 6, 0, False)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_mixed_steps_split_in_two_forwards_keep_the_tokens(quantized_dir, temperature):
    # A budget of 8 tokens chunks the prompts beside running decodes: most steps are mixed.
    kwargs = dict(gguf_max_rows=8, num_kv_blocks=256, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    params = [SamplingParams(max_tokens=n, temperature=temperature, seed=i, ignore_eos=True)
              for i, n in enumerate(NUM_TOKENS)]
    split = LLM(str(quantized_dir), split_mixed_steps=True, **kwargs)
    runner = split.engine.runner
    num_split = 0
    forward_split = runner._forward_split

    def counting(*args, **kw):  # noqa: ANN002, ANN003, ANN202 - a spy around the runner's own method
        nonlocal num_split
        num_split += 1
        return forward_split(*args, **kw)

    runner._forward_split = counting
    together = LLM(str(quantized_dir), split_mixed_steps=False, **kwargs)
    assert [r.token_ids for r in split.generate(PROMPTS, params)] == \
        [r.token_ids for r in together.generate(PROMPTS, params)]
    assert num_split > 0
