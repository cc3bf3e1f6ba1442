"""The layers every model family composes: RMSNorm, attention on the paged KV cache, the gated MLP.

Tokens arrive packed: one flat [T] batch holding prefill chunks and decodes of many sequences together; the
attention layer finds each sequence's rows and cached context through AttentionMetadata. Everything except
attention is per-token, so it needs no notion of sequences at all.

q/k/v and gate/up are fused into one Linear each at load time (models/base.py maps the checkpoint's names onto
them): fewer, larger matmuls suit a slow CPU. Each Linear is one shard today; a tensor-parallel split would cut
qkv_proj and gate_up_proj by column and o_proj and down_proj by row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from conveyor.kernels import cpu_fused
from conveyor.serving.attention import AttentionMetadata, PagedAttention
from conveyor.serving.models.rotary import apply_rope, head_dim


class RMSNorm(nn.Module):
    """With a residual, adds it first and returns (normed, sum): the sum is the next layer's residual.
    fused: one C++ call (conveyor/kernels/cpu_fused.py) instead of ~8 aten ops, updating x and residual in place."""

    def __init__(self, size: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = fused

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return cpu_fused.rms_norm(x, self.weight, self.eps) if self.fused else self._norm(x)
        if self.fused:
            cpu_fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: Tensor) -> Tensor:
        # Normalize in float32 as transformers does, so bf16 runs match it.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores weight - 1 (x * (1 + weight)), and the product is taken in float32
    before rounding to the activations' dtype. The fused C++ norm rounds before it multiplies (Llama's order), so
    this norm never takes it: in bfloat16 the results would differ from transformers'."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__(size, eps, fused=False)
        nn.init.zeros_(self.weight)

    def _norm(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Attention(nn.Module):
    """Fused qkv projection, optional per-head q/k RMSNorm (Qwen3, Gemma 3), rotary, paged attention, o_proj.
    The options a family sets beyond its config: bias on qkv and o, q/k norms (of class norm_cls), and what
    PagedAttention takes (its own softmax scale, a sliding window, logit soft-capping) through attn_options."""

    def __init__(self, config, backend: str, fused: bool = False, *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: bool = False, norm_cls: type[RMSNorm] = RMSNorm, **attn_options) -> None:
        super().__init__()
        self.fused = fused
        self.head_dim = head_dim(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, backend=backend,
                                   **{k: v for k, v in attn_options.items() if v is not None})
        self.has_qk_norm = qk_norm
        if qk_norm:
            self.q_norm = norm_cls(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm_cls(self.head_dim, config.rms_norm_eps)

    def shard_sizes(self) -> list[int]:
        """Rows of q, k and v in qkv_proj, in order (models/base.py loads the checkpoint's three into them)."""
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(self, rope: tuple[Tensor, Tensor], x: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> Tensor:
        qkv = self.qkv_proj(x)
        if self.has_qk_norm:
            qkv = self._norm_heads(qkv)
        if self.fused:
            self._rotate_fused(qkv, rope)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if not self.fused:
            q = apply_rope(q.view(-1, self.num_heads, self.head_dim), rope).reshape(-1, self.q_size)
            k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), rope).reshape(-1, self.kv_size)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out)

    def _rotate_fused(self, qkv: Tensor, rope: tuple[Tensor, Tensor]) -> None:
        """The C++ rope, in place. q and k heads are adjacent in each qkv row: one call rotates both. The kernel
        rotates whole heads, so a partial rotary (tables narrower than head_dim / 2) rotates a packed copy of each
        head's leading dims and writes it back."""
        heads, rotary_dim = self.num_heads + self.num_kv_heads, 2 * rope[0].shape[-1]
        if rotary_dim == self.head_dim:
            cpu_fused.rotary_embedding_neox(qkv, *rope, heads, self.head_dim)
            return
        part = qkv[:, :heads * self.head_dim].view(-1, heads, self.head_dim)[..., :rotary_dim]
        packed = part.reshape(-1, heads * rotary_dim)
        cpu_fused.rotary_embedding_neox(packed, *rope, heads, rotary_dim)
        part.copy_(packed.view_as(part))

    def _norm_heads(self, qkv: Tensor) -> Tensor:
        """qkv with each query and key head RMS-normalized, in the same [T, q + k + v] layout (so the fused rope
        still rotates q and k in one call)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).flatten(1)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).flatten(1)
        return torch.cat((q, k, v), dim=-1)


# hidden_act -> the function gate rows go through (transformers' ACT2FN names)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one Linear.
    fused: SiLU-and-mul is one C++ pass (conveyor/kernels/cpu_fused.py), not silu then mul (other activations
    take the torch ops)."""

    def __init__(self, config, fused: bool = False, *, intermediate_size: int | None = None,
                 bias: bool = False, act: str | None = None) -> None:
        super().__init__()
        act = act or getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r}; supported: {tuple(ACTIVATIONS)}")
        self.act = act
        self.fused = fused and act == "silu"
        self.intermediate = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=bias)

    def shard_sizes(self) -> list[int]:
        """Rows of gate and up in gate_up_proj, in order."""
        return [self.intermediate, self.intermediate]

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if self.fused:
            return self.down_proj(cpu_fused.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(ACTIVATIONS[self.act](gate) * up)
