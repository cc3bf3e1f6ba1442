"""Which class serves a checkpoint: `architectures` in its config.json -> (module, class), imported on first use.

A family registers here and nowhere else; an architecture not listed fails at start-up with the list of those
that are. Configs without `architectures` (old conversions) fall back on `model_type`.
"""
from __future__ import annotations

import importlib

# architecture -> (module under conveyor.serving.models, class)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "GemmaForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma", "Gemma3ForConditionalGeneration"),  # text prompts only
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
}

# model_type -> architecture, for configs that do not name one
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(ARCHITECTURES))


def architecture_of(config) -> str:
    """The first architecture of config we serve; ValueError naming the supported ones otherwise."""
    named = list(getattr(config, "architectures", None) or [])
    if not named and getattr(config, "model_type", None) in MODEL_TYPES:
        named = [MODEL_TYPES[config.model_type]]
    for arch in named:
        if arch in ARCHITECTURES:
            return arch
    raise ValueError(f"unsupported architecture {named or None} (model_type {getattr(config, 'model_type', None)!r});"
                     f" supported: {', '.join(supported_architectures())}")


def model_class(config) -> type:
    module, name = ARCHITECTURES[architecture_of(config)]
    return getattr(importlib.import_module(f"conveyor.serving.models.{module}"), name)
