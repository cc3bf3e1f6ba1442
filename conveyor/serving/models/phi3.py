"""Phi-3 and Phi-3.5 (Phi3ForCausalLM): Llama's decoder layer with the checkpoint's projections already fused.

The checkpoint holds qkv_proj (q | k | v rows) and gate_up_proj (gate | up rows), exactly the layout of our fused
Linears, so they load as they are. The 128k variants scale rope with LongRoPE (rotary.py); `sliding_window` in the
config (2047 in Phi-3-mini-4k) is the attention's window, as transformers applies it. Phi-4-mini (the same class)
rotates only the first head_dim * partial_rotary_factor dims of each head.
"""
from __future__ import annotations

import torch
from torch import nn

from conveyor.kernels import cpu_fused
from conveyor.serving.models.base import CausalLM
from conveyor.serving.models.layers import Attention, GatedMLP, RMSNorm
from conveyor.serving.models.llama import DecoderLayer
from conveyor.serving.models.rotary import RotaryEmbedding, partial_rotary_dim, rope_parameters

# Rope types older Phi-3 configs name that transformers' Phi3Config reads as LongRoPE.
_LONGROPE_ALIASES = ("su", "yarn")


def phi3_rope_parameters(config) -> dict:
    params = rope_parameters(config)
    if params["rope_type"] in _LONGROPE_ALIASES:
        params["rope_type"] = "longrope"
    return params


class Phi3DecoderLayer(DecoderLayer):
    """Llama's pre-norm layer; its attention keeps to the config's sliding window."""

    def __init__(self, config, backend: str, fused: bool = False) -> None:
        nn.Module.__init__(self)  # DecoderLayer's own attention is Llama's: build ours instead
        self.self_attn = Attention(config, backend, fused, sliding_window=getattr(config, "sliding_window", None))
        self.mlp = GatedMLP(config, fused)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)


class Phi3Model(nn.Module):
    def __init__(self, config, backend: str) -> None:
        super().__init__()
        # The "cpu" attention backend means our C++ CPU extension is built: its fused norm and rope come along.
        self.fused = backend == "cpu" and cpu_fused.is_available()
        # Given its weight, nn.Embedding skips a random init the checkpoint overwrites anyway (llama.py says why).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        params = phi3_rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(config, params, partial_rotary_dim(config, params))
        self.layers = nn.ModuleList(Phi3DecoderLayer(config, backend, self.fused)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.fused)


class Phi3ForCausalLM(CausalLM):
    FUSED_SHARDS: dict[str, tuple[str, int]] = {}  # the checkpoint's fused projections are ours as they are
    GGUF_BLOCKS = False  # llama.cpp's fused attn_qkv / ffn_up are not mapped

    def __init__(self, config, attention_backend: str = "torch") -> None:
        super().__init__(config)
        self.model = Phi3Model(config, attention_backend)
