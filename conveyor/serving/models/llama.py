"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral, Qwen2, Qwen3) composed from the shared layers.

Variants differ only in options: Qwen2 has q/k/v bias, Llama has it when attention_bias is set, Qwen3 normalizes
every query and key head (RMSNorm over head_dim) before the rotary embedding. Mistral's sliding window covers every
layer; Qwen2/Qwen3 slide only with use_sliding_window, in the layers layer_types (or max_window_layers) names.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from conveyor.kernels import cpu_fused
from conveyor.serving.attention import AttentionMetadata
from conveyor.serving.models.base import CausalLM
from conveyor.serving.models.layers import Attention, GatedMLP, RMSNorm
from conveyor.serving.models.rotary import RotaryEmbedding

QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")


QWEN_MODEL_TYPES = ("qwen2", "qwen3")


def layer_sliding_window(config, index: int) -> int | None:
    """Layer `index`'s sliding window, as transformers decides it: none without `sliding_window` or with
    `use_sliding_window` false; else `layer_types[index]` where the config lists them; else Qwen2/Qwen3 slide from
    layer `max_window_layers` on, and every other family (Mistral, Mixtral, Qwen3-MoE) in every layer."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[index] == "sliding_attention" else None
    if config.model_type in QWEN_MODEL_TYPES:
        return window if index >= getattr(config, "max_window_layers", 0) else None
    return window


def llama_attention(config, backend: str, fused: bool) -> Attention:
    qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    return Attention(config, backend, fused, qkv_bias=qkv_bias, o_bias=qkv_bias and config.model_type != "qwen2",
                     qk_norm=config.model_type in QK_NORM_MODEL_TYPES)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, the residual stream carried separately."""

    def __init__(self, config, backend: str, fused: bool = False, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = llama_attention(config, backend, fused)
        self.mlp = mlp if mlp is not None else GatedMLP(config, fused, bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)

    def forward(self, rope: tuple[Tensor, Tensor], x: Tensor, residual: Tensor | None,
                kv_cache: tuple[Tensor, Tensor], meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it); residual None: first layer."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, backend: str, layer_cls: type[nn.Module] = DecoderLayer,
                 rotary_emb: RotaryEmbedding | None = None) -> None:
        super().__init__()
        # The "cpu" attention backend means our C++ CPU extension is built: its fused norm and rope come along.
        self.fused = backend == "cpu" and cpu_fused.is_available()
        # Given its weight, nn.Embedding skips its random init: on the meta device that init imports torch._dynamo
        # (2 s of a replica's start on 2 cores), for values the checkpoint overwrites anyway.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.rotary_emb = RotaryEmbedding(config) if rotary_emb is None else rotary_emb
        self.layers = nn.ModuleList(layer_cls(config, backend, self.fused) for _ in range(config.num_hidden_layers))
        # Windows depend on the layer's index, which layer_cls (shared with the MoE families) is not given.
        for index, layer in enumerate(self.layers):
            layer.self_attn.attn.set_sliding_window(layer_sliding_window(config, index))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.fused)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config, attention_backend: str = "torch") -> None:
        super().__init__(config)
        self.model = LlamaModel(config, attention_backend)
