"""A tiny random-weight Llama (and its tokenizer) that tests build themselves: no hub, loads in a blink."""
from __future__ import annotations

from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital.",
    "Continuous batching admits new requests at every token step; paged attention keeps KV in blocks.",
    "héllo wörld, naïve café, 日本語のテキスト, emoji 🙂🚀, numbers 0123456789 and punctuation !?;:",
] * 20


def build_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def build_tiny_llama(path: Path, *, qkv_bias: bool = False, seed: int = 0, **config_overrides) -> Path:
    """Save a random Llama (or Qwen2 when qkv_bias) with a matching tokenizer into path; return path.
    config_overrides replace config fields (num_hidden_layers=1, hidden_size=..., for benchmarks)."""
    return build_tiny_model(path, "qwen2" if qkv_bias else "llama", seed=seed, **config_overrides)


# family -> (transformers config class, model class, config fields of its own)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True, "use_sliding_window": False}),
    # 8 experts, top-2 weights as the router gives them; layer 1 dense (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": False,
        "mlp_only_layers": [1], "use_sliding_window": False}),
    # every layer slides (window 8): the experts under windowed attention and freed blocks
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "sliding_window": 8}),
    # Every layer slides with window 8: the test prompts are longer
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8, "tie_word_embeddings": False}),
    # Layer 0 local (window 8, shorter than most test prompts), layer 1 global; the query scale apart from head_dim
    # and soft caps low enough to bite.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "sliding_window": 8, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 10.0,
        "final_logit_softcapping": 15.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "sliding_window": 8, "query_pre_attn_scalar": 32, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 8, "tie_word_embeddings": False, "pad_token_id": 0}),
}


def build_tiny_model(path: Path, family: str, *, seed: int = 0, **config_overrides) -> Path:
    """Save a random model of `family` (FAMILIES), built by transformers' own classes, with a matching tokenizer
    into path; return path."""
    import torch
    import transformers

    config_cls, model_cls, own = FAMILIES[family]
    tokenizer = build_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **own)
    common.update(config_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**common))
    # Spread the logits so greedy decoding has clear winners instead of near-ties between code paths.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # stacked experts are [E, out, in]
                p.mul_(4.0)
            elif family.startswith("gemma") and "norm" in name:  # stored as offsets from 1; zeros hide a misuse
                p.copy_(0.3 * torch.randn(p.shape))
            elif "q_norm" in name or "k_norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape))  # ones would hide a norm applied to the wrong axis
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cast_copy(model_dir: Path, out: Path, dtype, *, config_names_it: bool = True) -> Path:
    """A copy of model_dir with its weights stored in dtype, as a bf16/fp16 checkpoint is; config.json names
    the dtype, or (config_names_it False) leaves it to the weights."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = {k: v.to(dtype) for k, v in load_file(str(out / "model.safetensors")).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    if config_names_it:
        config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config))
    return out


def quantize_copy(model_dir: Path, out: Path) -> Path:
    """A copy of model_dir as if converted from a GGUF: linears in Q4_1 blocks (the LM head Q8_0), and the fp32
    checkpoint holding exactly what those blocks dequantize to. Needs the CPU extension (kernels.gguf)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from conveyor.kernels import gguf
    from conveyor.serving.models.gguf_weights import save_blocks

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    weights = load_file(str(out / "model.safetensors"))
    blocks, types = {}, {}
    for name, tensor in weights.items():
        if tensor.dim() == 2 and name.endswith("proj.weight") or name == "lm_head.weight":
            ggml_type = gguf.Q8_0 if name == "lm_head.weight" else gguf.Q4_1
            blocks[name] = quantize(tensor, ggml_type)
            types[name] = gguf.TYPE_NAMES[ggml_type]
            weights[name] = gguf.dequantize(blocks[name], ggml_type, tensor.shape[1])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_blocks(out, blocks, types)
    return out


def quantize(weight, ggml_type: int):  # noqa: ANN001, ANN201 - torch.Tensor in and out
    """float [N, K] -> uint8 blocks [N, K / 32 * block bytes], ggml's round-to-nearest scheme (a model gets its
    blocks from a GGUF file: conveyor/kernels/gguf.py has no quantizer)."""
    import torch

    from conveyor.kernels import gguf

    num_rows, in_features = weight.shape
    gguf.row_bytes(ggml_type, in_features)  # validates type and K
    w = weight.float().reshape(num_rows, in_features // gguf.BLOCK, gguf.BLOCK)
    if ggml_type == gguf.Q8_0:
        scale = (w.abs().amax(-1, keepdim=True) / 127).half()
        inv = torch.where(scale.float() > 0, 1 / scale.float(), torch.zeros(()))
        q = (w * inv).round().clamp(-127, 127).to(torch.int8)
        parts = [scale.view(torch.uint8), q.view(torch.uint8)]
    else:
        low = w.amin(-1, keepdim=True)
        scale = ((w.amax(-1, keepdim=True) - low) / 15).half()
        inv = torch.where(scale.float() > 0, 1 / scale.float(), torch.zeros(()))
        q = ((w - low.half().float()) * inv).round().clamp(0, 15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        parts = [scale.view(torch.uint8), low.half().view(torch.uint8), packed]
    return torch.cat(parts, dim=-1).reshape(num_rows, -1).contiguous()
