"""Phi-3 and Phi-3.5 (Phi3ForCausalLM): Llama's decoder layer with the checkpoint's projections already fused.

The checkpoint holds qkv_proj (q | k | v rows) and gate_up_proj (gate | up rows), exactly the layout of our fused
Linears, so they load as they are. The 128k variants scale rope with LongRoPE (rotary.py); `sliding_window` in the
config (2047 in Phi-3-mini-4k) is the attention's window, as transformers applies it. Phi-4-mini (the same class)
rotates only the first head_dim * partial_rotary_factor dims of each head.
"""
from __future__ import annotations

from conveyor.serving.models.base import CausalLM
from conveyor.serving.models.llama import LlamaModel
from conveyor.serving.models.rotary import RotaryEmbedding, partial_rotary_dim, rope_parameters

# Rope types older Phi-3 configs name that transformers' Phi3Config reads as LongRoPE.
_LONGROPE_ALIASES = ("su", "yarn")


def phi3_rope_parameters(config) -> dict:
    params = rope_parameters(config)
    if params["rope_type"] in _LONGROPE_ALIASES:
        params["rope_type"] = "longrope"
    return params


def phi3_rotary(config) -> RotaryEmbedding:
    params = phi3_rope_parameters(config)
    return RotaryEmbedding(config, params, partial_rotary_dim(config, params))


class Phi3ForCausalLM(CausalLM):
    FUSED_SHARDS: dict[str, tuple[str, int]] = {}  # the checkpoint's fused projections are ours as they are
    GGUF_BLOCKS = False  # llama.cpp's fused attn_qkv / ffn_up are not mapped

    def __init__(self, config, attention_backend: str = "torch") -> None:
        super().__init__(config)
        # Llama's layers: no Phi-3 config sets the biases or q/k norms, and sliding_window covers every layer.
        self.model = LlamaModel(config, attention_backend, rotary_emb=phi3_rotary(config))
