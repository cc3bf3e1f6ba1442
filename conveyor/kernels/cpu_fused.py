"""Fused RMSNorm (+ residual add), rotary embedding and silu-and-mul on CPU: torch.ops.conveyor_cpu from
csrc/cpu/fused_ops_cpu.cpp.

They live in the CPU extension that cpu_ext.py builds; loading it registers the ops. Callers check
`is_available()` once (at model build) and keep the plain torch path otherwise.
"""
from __future__ import annotations

import torch

from conveyor.kernels import cpu_ext


def is_available() -> bool:
    """Whether the extension builds and loads here (the first call may compile it)."""
    return cpu_ext.has_op("rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim of x [T, N], computed in float32 (transformers' rounding)."""
    return torch.ops.conveyor_cpu.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual <- x + residual, then x <- rms_norm(residual) (vLLM's fused_add_rms_norm)."""
    torch.ops.conveyor_cpu.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding_neox(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                          head_dim: int) -> None:
    """Rotate-half rope, in place, on the first num_heads heads of every row of qk [T, >= num_heads*head_dim]
    (rows may be strided, e.g. the q|k part of a fused qkv output); cos/sin float32 [T, head_dim/2]."""
    torch.ops.conveyor_cpu.rotary_embedding_neox(qk, cos, sin, num_heads, head_dim)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :n]) * x[:, n:] for x [T, 2n] with contiguous rows (vLLM's silu_and_mul): one pass, no [T, n]
    intermediate."""
    return torch.ops.conveyor_cpu.silu_and_mul(x)
