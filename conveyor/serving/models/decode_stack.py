"""A decode step's decoder layers in one C++ call (conveyor/kernels/csrc/cpu/decode_stack_cpu.cpp).

At batch 1-4 on a small CPU, the Python between a decode step's ~300 kernel calls (module calls, views, splits,
the dispatcher's Python entry) costs about as much as the kernels that do not read weights. The C++ loop calls
the same kernels in the same order on the same tensors, so its hidden states equal the module path's bit for
bit (tests/serving/test_decode_stack.py); only the glue goes. It covers what that glue would run for a CPU float32
model whose projections all multiply by GGUF blocks (models/gguf_weights.py), steps where every row is a decode
and there are few enough rows for those blocks; every other step takes the module path.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from conveyor.kernels import cpu_ext, gguf
from conveyor.serving.attention import AttentionMetadata
from conveyor.serving.models.gguf_weights import GGUFLinear
from conveyor.serving.models.llama import DecoderLayer
from conveyor.serving.models.moe import MoEBlock

_PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def unavailable_reason(model: nn.Module) -> str | None:
    """Why `model` (a LlamaForCausalLM) cannot run decode steps through the C++ loop, or None when it can."""
    if not cpu_ext.has_op("decode_layers"):
        return "the CPU extension did not build"
    if not model.model.fused:  # true exactly where the attention backend is "cpu" and the extension loaded
        return "the model does not use the CPU kernels (attention backend is not 'cpu')"
    if any(isinstance(layer.mlp, MoEBlock) for layer in model.model.layers):
        return "the C++ decode loop has no mixture-of-experts layers"
    layer = model.model.layers[0]
    if type(layer) is not DecoderLayer:  # Gemma's four norms and GELU
        return f"the C++ decode loop runs Llama's decoder layer, not {type(layer).__name__}"
    if model.model.rotary_emb.rotary_dim != layer.self_attn.head_dim:
        return "the C++ decode loop rotates whole heads, not the first partial_rotary_factor of each (Phi-4-mini)"
    if layer.self_attn.has_qk_norm:
        return "the C++ decode loop has no query/key head norms (Qwen3)"
    if any(lay.self_attn.attn.sliding_window or lay.self_attn.attn.logits_soft_cap for lay in model.model.layers):
        return "the C++ decode loop has no sliding window or logit soft-capping"
    for layer in model.model.layers:
        for part, name in _PROJECTIONS:
            linear = getattr(getattr(layer, part), name)
            if not isinstance(linear, GGUFLinear):
                return f"{part}.{name} is not in GGUF blocks"
            if linear.bias is not None:
                return f"{part}.{name} has a bias"
    return None


class DecodeStack:
    """The per-layer tensors in decode_layers' order, gathered once at load time."""

    def __init__(self, model: nn.Module) -> None:
        reason = unavailable_reason(model)
        if reason is not None:
            raise ValueError(f"decode stack unavailable: {reason}")
        layers = model.model.layers
        attn = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale = attn.attn.scale
        self.eps = float(model.model.norm.eps)
        self.final_norm = model.model.norm.weight.detach()
        self.weights: list[Tensor] = []
        self.ggml_types: list[int] = []
        max_rows, bf16_min_rows, int8 = set(), set(), set()
        for layer in layers:
            self.weights += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
            for part, name in _PROJECTIONS:
                linear = getattr(getattr(layer, part), name)
                int8_weight = linear.int8_weight
                self.weights.append(linear.weight.blocks)
                if int8_weight is None:
                    self.weights += [linear.weight.q, linear.weight.scales]
                else:
                    self.weights += [int8_weight.u, int8_weight.dm]
                self.ggml_types.append(linear.ggml_type)
                max_rows.add(linear.max_rows)
                bf16_min_rows.add(linear.bf16_min_rows or 0)
                int8.add(int8_weight is not None)
        # Steps past the smallest max_rows would send some projection to its fp32 weights: the module path's.
        self.max_rows = min(max_rows)
        self.rows_kernel_max_rows = (gguf.ROWS_KERNEL_MAX_ROWS[gguf.Q4_1], gguf.ROWS_KERNEL_MAX_ROWS[gguf.Q8_0])
        # cpu_prefill_dtype bfloat16 gives every layer linear one bf16 threshold (0: fp32 throughout).
        if len(bf16_min_rows) != 1:
            raise ValueError(f"decode stack: the layers' linears disagree on bf16_min_rows ({sorted(bf16_min_rows)})")
        self.bf16_min_rows = bf16_min_rows.pop()
        if len(int8) != 1:
            raise ValueError("decode stack: some of the layers' linears multiply in int8, some not")
        self.int8_activations = int8.pop()
        # The runner's cache list lives as long as the engine: split it into key and value lists once.
        self._kv_source: list[tuple[Tensor, Tensor]] | None = None
        self._key_caches: list[Tensor] = []
        self._value_caches: list[Tensor] = []

    def handles(self, num_rows: int, meta: AttentionMetadata) -> bool:
        """Whether this step is one the C++ loop runs: every row a decode, and few enough for the blocks."""
        return meta.max_query_len == 1 and 0 < num_rows <= self.max_rows and meta.seq_lens.shape[0] == num_rows

    def __call__(self, x: Tensor, rope: tuple[Tensor, Tensor], kv_caches: list[tuple[Tensor, Tensor]],
                 meta: AttentionMetadata) -> Tensor:
        """Embedded tokens x [T, hidden] -> final normed hidden states [T, hidden], as the module path."""
        if kv_caches is not self._kv_source:
            self._kv_source = kv_caches
            self._key_caches = [k for k, _ in kv_caches]
            self._value_caches = [v for _, v in kv_caches]
        cos, sin = rope
        return torch.ops.conveyor_cpu.decode_layers(
            x, self.weights, self.ggml_types, self._key_caches, self._value_caches, self.final_norm, cos, sin,
            meta.slot_mapping.to(torch.long).contiguous(), meta.block_tables.to(torch.int32).contiguous(),
            meta.seq_lens.to(torch.int32).contiguous(), self.num_heads, self.num_kv_heads, self.head_dim, self.eps,
            self.scale, *self.rows_kernel_max_rows, self.bf16_min_rows, self.int8_activations)
