"""Mixtral: the Mistral decoder with a mixture-of-experts block as every layer's MLP; the router always
renormalizes its top-k weights, and each expert is a SiLU-gated MLP of `intermediate_size`.

Checkpoints name the block `block_sparse_moe` and an expert's gate/down/up projections w1/w2/w3; they load into
the same MoEBlock as Qwen3-MoE's (`mlp`, stacked gate_up_proj and down_proj).
"""
from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from conveyor.serving.models.llama import DecoderLayer, LlamaModel
from conveyor.serving.models.moe import MoEBlock, MoECausalLM, num_experts


def mixtral_layer(config, backend: str, fused: bool) -> DecoderLayer:
    mlp = MoEBlock(config, fused, num_experts=num_experts(config), top_k=config.num_experts_per_tok,
                   intermediate_size=config.intermediate_size, renormalize=True)
    return DecoderLayer(config, backend, fused, mlp=mlp)


class MixtralForCausalLM(MoECausalLM):
    def __init__(self, config, attention_backend: str = "torch") -> None:
        super().__init__(config)
        self.model = LlamaModel(config, attention_backend, layer_cls=mixtral_layer)

    def checkpoint_weights(self, weights: Iterable[tuple[str, Tensor]]) -> Iterable[tuple[str, Tensor]]:
        for name, tensor in weights:
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor
