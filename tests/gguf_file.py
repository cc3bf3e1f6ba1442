"""Write a tiny HF checkpoint as llama.cpp's convert_hf_to_gguf.py would (the `gguf` package's writer): llama.cpp
tensor names, Q8_0 linears and embedding, fp32 norms, the tokenizer and chat template in the metadata, q/k rows
permuted for the `llama` architecture only (as llama.cpp does)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

_ARCHS = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "phi3": "PHI3", "gemma2": "GEMMA2",
          "gemma3": "GEMMA3"}
EOT_TOKEN_ID = 1  # <|im_start|>, standing in for an end-of-turn token other than EOS
SAMPLING = {"temp": 0.7, "top_p": 0.8, "top_k": 20}  # Qwen3's recommended sampling


def _permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's interleaving of a Llama q/k projection's rows (convert_hf_to_gguf.py LlamaModel.permute)."""
    return rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(
        rows.shape)


def _add_tokenizer(writer, model_dir: Path, config: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"]) | {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: CONTROL, 1: NORMAL
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_eot_token_id(EOT_TOKEN_ID)
    if config.get("pad_token_id") is not None:
        writer.add_pad_token_id(config["pad_token_id"])
    template = model_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


def write_gguf(model_dir: Path, out: Path, family: str) -> Path:
    """The checkpoint at model_dir (a `family` of tests/tiny_model.py in _ARCHS) as a GGUF at out. Settings the GGUF
    layout has no key for (Gemma's soft caps and query scale, Gemma 3's rope scaling) take transformers' defaults
    in the conversion."""
    import gguf

    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = getattr(gguf.MODEL_ARCH, _ARCHS[family])
    num_layers, num_heads = config["num_hidden_layers"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name("tiny")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3 has one per layer type
    writer.add_rope_freq_base(config.get("rope_theta") or rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for key, value in SAMPLING.items():  # as llama.cpp copies them from the model's generation_config.json
        getattr(writer, f"add_sampling_{key}")(value)
    _add_tokenizer(writer, Path(model_dir), config)
    names = gguf.get_tensor_name_map(arch, num_layers)
    for name, tensor in load_file(str(Path(model_dir) / "model.safetensors")).items():
        if family == "llama" and name.endswith("q_proj.weight"):
            tensor = _permute(tensor, num_heads)
        elif family == "llama" and name.endswith("k_proj.weight"):
            tensor = _permute(tensor, config["num_key_value_heads"])
        if family.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1.0  # llama.cpp stores Gemma's norms as 1 + the offsets transformers keeps
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if tensor.ndim == 2:
            q8_0 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(tensor.astype(np.float32), q8_0), raw_dtype=q8_0)
        else:
            writer.add_tensor(gguf_name, tensor.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
