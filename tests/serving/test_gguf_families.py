"""`--model file.gguf` for families other than SmolLM2's Llama: a tiny checkpoint written as llama.cpp writes it
(tests/gguf_file.py: Q8_0 linears, q/k rows permuted for `llama` only) converts, keeps its quantized blocks for
the small CPU steps, and answers transformers' greedy tokens on the same (dequantized) weights."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from conveyor.serving import LLM, SamplingParams
from conveyor.serving.models.hub import COMPLETE_MARKER, is_complete
from conveyor.serving.models.loader import generation_defaults, generation_eos_ids, resolve_model_path
from tests.cpu_ext_gate import require_cpu_ext
from tests.gguf_file import EOT_TOKEN_ID, write_gguf
from tests.serving.test_model_families import _hf_greedy
from tests.tiny_model import build_tiny_model

require_cpu_ext("gguf_linear")

PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 7, 120, 33, 2, 9], list(range(40, 75)), [11, 12, 13]]
NUM_TOKENS = [14, 10, 12]


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama", "phi3", "gemma2", "gemma3"])
def gguf_model(request, tmp_path_factory):
    """(the .gguf file, its converted folder), converted into a cache of the test's own."""
    family = request.param
    root = tmp_path_factory.mktemp(f"gguf-{family}")
    hf_dir = build_tiny_model(root / "hf", family)
    gguf_path = write_gguf(hf_dir, root / f"tiny-{family}.gguf", family)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONVEYOR_CACHE_DIR", str(root / "cache"))
        yield gguf_path, resolve_model_path(str(gguf_path))


def test_the_conversion_keeps_the_shape_and_the_sampling_defaults(gguf_model):
    _, converted = gguf_model
    config = json.loads((converted / "config.json").read_text())
    assert config.get("head_dim", 16) == 16  # Qwen3's key_length, which transformers' reader leaves out
    if config["model_type"] in ("phi3", "gemma2", "gemma3_text"):
        assert config["sliding_window"] == 8  # Phi-3's, which transformers' reader leaves out
    assert generation_defaults(converted) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert generation_eos_ids(converted) == (config["eos_token_id"], EOT_TOKEN_ID)  # llama.cpp's eot id ends turns


def test_conversions_of_the_older_format_are_redone_except_llamas(gguf_model, tmp_path):
    """Format 2 un-permuted Qwen's q/k blocks and lost Qwen3's head_dim: such a folder converts again; a Llama's
    (SmolLM2's) holds what format 3 would, and is kept."""
    older = shutil.copytree(gguf_model[1], tmp_path / "older")
    assert is_complete(older)
    (older / COMPLETE_MARKER).write_text("source=x.gguf\nformat=2\n")
    assert is_complete(older) == (json.loads((older / "config.json").read_text())["model_type"] == "llama")


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(gguf_model, caplog):
    gguf_path, converted = gguf_model
    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    expected = [_hf_greedy(hf, p, n) for p, n in zip(PROMPTS, NUM_TOKENS, strict=True)]
    with caplog.at_level(logging.INFO, logger="conveyor.serving.models.gguf_weights"):
        llm = LLM(str(gguf_path), num_kv_blocks=64, block_size=4)
    assert llm.engine.dtype == torch.float32
    if type(llm.engine.model).GGUF_BLOCKS:  # Llama's layout: Llama, Mistral, Qwen2, Qwen3
        assert llm.engine.num_gguf_linears == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the LM head
    else:  # Gemma's offset norms, Phi-3's fused attn_qkv: the fp32 conversion serves every step, and says so
        assert llm.engine.num_gguf_linears == 0
        assert "GGUF blocks not used" in caplog.text
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in NUM_TOKENS]
    assert [r.token_ids for r in llm.generate(PROMPTS, params)] == expected
    chat = llm.engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")  # the GGUF's template
