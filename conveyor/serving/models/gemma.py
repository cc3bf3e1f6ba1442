"""Gemma 2 and Gemma 3 (text) decoders composed from the shared layers.

Both differ from Llama in the same ways: the embedding is scaled by sqrt(hidden_size), every norm stores its
weight as an offset from 1 (GemmaRMSNorm), attention and MLP each sit between a pre- and a post-norm (four norms
per layer), the softmax scale comes from query_pre_attn_scalar, the MLP is GELU-tanh gated, and layers alternate
between sliding-window ("sliding_attention") and global ("full_attention") attention. Gemma 2 soft-caps the
attention scores and the final logits (tanh); Gemma 3 instead normalizes every query and key head, and gives its
local layers their own rope base (rope_local_base_freq): two rotary tables, each layer reads its own type's.
A Gemma 3 multimodal checkpoint (Gemma3ForConditionalGeneration) serves text prompts with its language model.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from conveyor.kernels import cpu_fused
from conveyor.serving.attention import AttentionMetadata
from conveyor.serving.models.base import CausalLM
from conveyor.serving.models.hub import log
from conveyor.serving.models.layers import Attention, GatedMLP, GemmaRMSNorm
from conveyor.serving.models.rotary import RotaryEmbedding, rope_parameters

SLIDING, FULL = "sliding_attention", "full_attention"
# Configs written before `layer_types`: one global layer every this many (the rest local), as transformers' rule.
_DEFAULT_PATTERN = {"gemma2": 2, "gemma3_text": 6}


def layer_types(config) -> list[str]:
    """Each layer's attention type: the config's `layer_types`, else every `sliding_window_pattern`-th layer
    global (Gemma 2: every second, layers 1, 3, ...)."""
    types = list(getattr(config, "layer_types", None) or [])
    if not types:
        pattern = (getattr(config, "sliding_window_pattern", None)
                   or _DEFAULT_PATTERN.get(config.model_type, 2))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"layer_types must name {config.num_hidden_layers} layers as {SLIDING!r} or {FULL!r}, "
                         f"got {types}")
    return types


def gemma3_rope_parameters(config, layer_type: str) -> dict:
    """A layer type's rope: transformers 5 keys `rope_parameters` by layer type; older configs give the global
    layers rope_theta (+ rope_scaling) and the local ones rope_local_base_freq, unscaled."""
    nested = getattr(config, "rope_parameters", None) or {}
    if isinstance(nested.get(layer_type), dict) or layer_type == FULL:
        return rope_parameters(config, layer_type)
    return {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around attention and around the MLP; the residual stream carried separately."""

    def __init__(self, config, backend: str, fused: bool, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        bias = bool(getattr(config, "attention_bias", False))
        # (transformers' defaults where a config.json read as a plain config leaves a field out)
        self.self_attn = Attention(
            config, backend, fused, qkv_bias=bias, o_bias=bias, qk_norm=config.model_type == "gemma3_text",
            norm_cls=GemmaRMSNorm, scale=getattr(config, "query_pre_attn_scalar", 256) ** -0.5,
            sliding_window=getattr(config, "sliding_window", 4096) if layer_type == SLIDING else None,
            logits_soft_cap=getattr(config, "attn_logit_softcapping", None))
        # transformers' Gemma reads hidden_activation (hub configs may carry a different, unused hidden_act)
        self.mlp = GatedMLP(config, fused, act=getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh")
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, rope: dict[str, tuple[Tensor, Tensor]], x: Tensor, residual: Tensor | None,
                kv_cache: tuple[Tensor, Tensor], meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """(x, residual) -> (this layer's post-normed MLP output, the residual stream before it)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope[self.layer_type], x, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, config, backend: str) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (Gemma embedding models) is not supported: "
                             "Conveyor serves causal decoders")
        # The "cpu" backend's fused rope and SiLU-and-mul; Gemma's norms and GELU stay torch ops.
        self.fused = backend == "cpu" and cpu_fused.is_available()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        types = layer_types(config)
        if config.model_type == "gemma3_text":
            self.rotary_emb = RotaryEmbedding(config, gemma3_rope_parameters(config, FULL))
            self.local_rotary_emb = RotaryEmbedding(config, gemma3_rope_parameters(config, SLIDING))
        else:
            self.rotary_emb = RotaryEmbedding(config)
            self.local_rotary_emb = None  # one table for both layer types
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, backend, self.fused, t) for t in types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(CausalLM):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (model_type gemma2, gemma3_text)."""
    GGUF_BLOCKS = False  # conversion un-permutes q/k rows as llama.cpp permutes Llama's only

    def __init__(self, config, attention_backend: str = "torch") -> None:
        super().__init__(config)
        self.model = GemmaModel(config, attention_backend)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def embed(self, input_ids: Tensor) -> Tensor:
        x = self.model.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the activations' dtype first, as transformers' scaled embedding does.
        return x * torch.tensor(self.config.hidden_size ** 0.5).to(x.dtype)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        local = self.model.local_rotary_emb
        tables = {FULL: self.model.rotary_emb, SLIDING: self.model.rotary_emb if local is None else local}
        looked_up = {id(t): (t.fused_tables(positions) if self.model.fused else t(positions, dtype))
                     for t in tables.values()}
        return {kind: looked_up[id(t)] for kind, t in tables.items()}

    def compute_logits(self, hidden: Tensor) -> Tensor:
        # In float32 (transformers caps in the model's dtype): the same to float32 rounding, closer in bfloat16.
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """A Gemma 3 multimodal checkpoint served for text prompts: its language model (loader.read_config gives the
    text_config) with the weights renamed from `language_model.model.*` (the layout transformers saves and the hub
    holds) or `model.language_model.*` (transformers 5's module names) to Gemma3ForCausalLM's; the vision tower and
    the projector are never read."""
    SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.",
                        "model.vision_tower.", "model.multi_modal_projector.")
    _RENAMES = {"language_model.model.": "model.", "model.language_model.": "model.",
                "language_model.lm_head.": "lm_head."}

    def __init__(self, config, attention_backend: str = "torch") -> None:
        super().__init__(config, attention_backend)
        # transformers' multimodal class takes the LM head's logits as they are, whatever text_config's
        # final_logit_softcapping says (Gemma 3's own checkpoints leave it null)
        self.final_logit_softcapping = None
        log("Gemma3ForConditionalGeneration: serving its language model for text prompts; the vision tower and "
            "projector weights are not loaded (image inputs are not supported)")

    def checkpoint_weights(self, weights: Iterable[tuple[str, Tensor]]) -> Iterable[tuple[str, Tensor]]:
        for name, tensor in weights:
            prefix = next((p for p in self._RENAMES if name.startswith(p)), None)
            yield (name if prefix is None else self._RENAMES[prefix] + name[len(prefix):]), tensor
