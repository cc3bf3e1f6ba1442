"""Checkpoint folders as users have them: `dtype: auto` from the stored dtype, sharded safetensors through their
index (models/checkpoint.py)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conveyor.serving import LLM, SamplingParams
from conveyor.serving.models import checkpoint
from conveyor.serving.models.checkpoint import choose_dtype, safetensors_files, stored_dtype
from conveyor.serving.models.hub import COMPLETE_MARKER
from conveyor.serving.models.loader import resolve_device_dtype
from tests.tiny_model import cast_copy

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(("stored", "device", "native", "expected"), [
    (F32, CPU, True, F32), (F32, CUDA, True, F32),  # fp32 stays fp32 everywhere
    (BF16, CUDA, True, BF16), (F16, CUDA, True, F16), (BF16, CUDA, False, F32),  # a GPU without bf16
    (BF16, CPU, True, BF16), (BF16, CPU, False, F32),  # bf16 on a CPU only with AVX512-BF16 or AMX
    (F16, CPU, True, F32),  # CPUs have no fast fp16 matmul
    (None, CPU, True, F32), (None, CUDA, True, F32),
])
def test_auto_takes_the_stored_dtype_where_the_device_computes_it(stored, device, native, expected):
    dtype, reason = choose_dtype(stored, device, cuda_bf16=native, cpu_bf16=native)
    assert dtype == expected and reason


def test_a_gguf_conversion_keeps_fp32_on_cpu_and_bf16_on_cuda():
    assert choose_dtype(F32, CPU, from_gguf=True, cpu_bf16=True)[0] == F32  # the default model stays fp32
    assert choose_dtype(F32, CUDA, from_gguf=True)[0] == BF16


def test_stored_dtype_reads_config_then_the_weights(tiny_model_dir, tmp_path):
    assert json.loads((tiny_model_dir / "config.json").read_text())["dtype"] == "float32"  # what save_pretrained writes
    assert stored_dtype(tiny_model_dir) == F32
    assert stored_dtype(cast_copy(tiny_model_dir, tmp_path / "bf16", BF16)) == BF16
    assert stored_dtype(cast_copy(tiny_model_dir, tmp_path / "f16", F16, config_names_it=False)) == F16


def test_the_engine_resolves_auto_from_the_checkpoint(tiny_model_dir, tmp_path, monkeypatch, capsys):
    bf16 = cast_copy(tiny_model_dir, tmp_path / "bf16", BF16)
    for native in (True, False):
        monkeypatch.setattr(checkpoint, "native_cpu_bf16", lambda n=native: n)
        assert resolve_device_dtype("cpu", "auto", str(bf16)) == (CPU, BF16 if native else F32)
    assert "dtype auto: float32 (the checkpoint is bfloat16 but this CPU has no AVX512-BF16" in capsys.readouterr().err
    assert resolve_device_dtype("cpu", "auto", str(tiny_model_dir)) == (CPU, F32)
    assert resolve_device_dtype("cpu", "bfloat16", str(tiny_model_dir)) == (CPU, BF16)  # named: as named
    (bf16 / COMPLETE_MARKER).write_text("format=2\n")  # as if converted from a GGUF
    assert resolve_device_dtype("cpu", "auto", str(bf16)) == (CPU, F32)


def test_an_fp16_checkpoint_runs_fp32_on_cpu(tiny_model_dir, tmp_path):
    llm = LLM(str(cast_copy(tiny_model_dir, tmp_path / "f16", F16)), num_kv_blocks=32)
    assert llm.engine.dtype == F32 and next(llm.engine.model.parameters()).dtype == F32


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.tiny_model import build_tiny_model

    single = build_tiny_model(tmp_path_factory.mktemp("single"), "qwen3")
    out = tmp_path_factory.mktemp("sharded")
    AutoModelForCausalLM.from_pretrained(single, dtype=F32).save_pretrained(out, max_shard_size="50KB")
    AutoTokenizer.from_pretrained(single).save_pretrained(out)
    return single, out


def test_sharded_checkpoints_load_the_shards_their_index_names(sharded_dir):
    single, sharded = sharded_dir
    shards = safetensors_files(sharded)
    assert len(shards) > 2 and (sharded / checkpoint.INDEX_FILE).is_file()
    # A stray file (a leftover, a consolidated copy) is not the model: it is not read.
    save_file({"stray.weight": torch.zeros(2)}, str(sharded / "consolidated.safetensors"))
    assert safetensors_files(sharded) == shards
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 99, 3, 42], list(range(40, 60))]
    expected = [r.token_ids for r in LLM(str(single), num_kv_blocks=64).generate(prompts, params)]
    assert [r.token_ids for r in LLM(str(sharded), num_kv_blocks=64).generate(prompts, params)] == expected


def test_an_index_naming_a_missing_shard_fails_clearly(sharded_dir, tmp_path):
    broken = shutil.copytree(sharded_dir[1], tmp_path / "broken")
    safetensors_files(broken)[0].unlink()
    with pytest.raises(ValueError, match="names shards that are missing"):
        safetensors_files(broken)


def test_generation_config_eos_ids_stop_requests(tiny_model_dir, tmp_path):
    """A second end-of-turn id in generation_config.json (Gemma 3's <end_of_turn>, Llama 3's <|eot_id|>) stops a
    request as EOS does, unless it ignores EOS."""
    prompt, free = list(range(40, 75)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = LLM(str(tiny_model_dir), num_kv_blocks=32).generate([prompt], free)[0].token_ids
    stop_at = next(i for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "eot")
    generation = json.loads((model_dir / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], tokens[stop_at]]
    (model_dir / "generation_config.json").write_text(json.dumps(generation))
    llm = LLM(str(model_dir), num_kv_blocks=32)
    assert llm.engine.extra_eos_token_ids == (tokens[stop_at],)
    stopped = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert stopped.token_ids == tokens[:stop_at + 1] and stopped.finish_reason == "stop"
    assert llm.generate([prompt], free)[0].token_ids == tokens


def test_the_chat_template_comes_from_chat_template_jinja(tiny_model_dir):
    """transformers 5 saves the template beside the tokenizer, not in tokenizer_config.json: it is still the one
    applied."""
    from conveyor.serving.detokenizer import apply_chat_template
    from conveyor.serving.models.loader import load_tokenizer

    assert "chat_template" not in json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert (tiny_model_dir / "chat_template.jinja").is_file()
    prompt = apply_chat_template(load_tokenizer(tiny_model_dir), [{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
