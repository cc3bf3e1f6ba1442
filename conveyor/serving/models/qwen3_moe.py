"""Qwen3-MoE: the Qwen3 decoder (q/k head norms) with a mixture-of-experts block as the MLP of its sparse layers.

A layer is sparse when it is not in `mlp_only_layers` and (index + 1) is a multiple of `decoder_sparse_step`
(transformers' rule); the others keep a dense gated MLP of `intermediate_size`. Experts have
`moe_intermediate_size`; `norm_topk_prob` says whether the top-k router weights are renormalized to sum to 1.
"""
from __future__ import annotations

from torch import nn

from conveyor.serving.models.layers import GatedMLP
from conveyor.serving.models.llama import DecoderLayer, LlamaModel
from conveyor.serving.models.moe import MoEBlock, MoECausalLM, num_experts, numbered_layers


def is_sparse_layer(config, index: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (index not in (getattr(config, "mlp_only_layers", None) or []) and num_experts(config) > 0
            and (index + 1) % step == 0)


def qwen3_moe_layer(config, backend: str, fused: bool, index: int) -> nn.Module:
    if is_sparse_layer(config, index):
        mlp = MoEBlock(config, fused, num_experts=num_experts(config), top_k=config.num_experts_per_tok,
                       intermediate_size=config.moe_intermediate_size,
                       renormalize=bool(getattr(config, "norm_topk_prob", False)))
    else:
        mlp = GatedMLP(config, fused)
    return DecoderLayer(config, backend, fused, mlp=mlp)


class Qwen3MoeForCausalLM(MoECausalLM):
    def __init__(self, config, attention_backend: str = "torch") -> None:
        super().__init__(config)
        self.model = LlamaModel(config, attention_backend, layer_cls=numbered_layers(qwen3_moe_layer))
