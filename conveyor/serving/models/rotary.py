"""Rotary position embeddings: the inverse-frequency variants transformers' checkpoints name in `rope_parameters`
(or `rope_theta` + `rope_scaling` in older configs), one cos/sin table per model, and the rotate-half rotation.

A variant is a function config-params -> inv_freq [rotary_dim // 2] in float32, registered in ROPE_INIT; the
tables are built once and indexed by each token's position, so a variant costs nothing per step."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; older configs: rope_theta + rope_scaling."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    scaling = getattr(config, "rope_scaling", None)
    if scaling and "rope_type" not in params:
        params.update(scaling)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _base_inv_freq(theta: float, dim: int) -> Tensor:
    # On the CPU even inside a meta-device build: meta arithmetic runs torch's Python references, which import
    # torch._dynamo (~2 s of a replica's start on 2 cores).
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _default(params: dict, dim: int, config) -> Tensor:
    return _base_inv_freq(params["rope_theta"], dim)


def _linear(params: dict, dim: int, config) -> Tensor:
    return _base_inv_freq(params["rope_theta"], dim) / params["factor"]


def _llama3(params: dict, dim: int, config) -> Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


# rope_type -> inv_freq function. Variants that also scale the tables (YaRN's attention factor, LongRoPE's) return
# that factor through ROPE_TABLE_SCALE.
ROPE_INIT: dict[str, Callable[[dict, int, object], Tensor]] = {
    "default": _default, "linear": _linear, "llama3": _llama3,
}
ROPE_TABLE_SCALE: dict[str, Callable[[dict, object], float]] = {}


def rope_inv_freq(config) -> Tensor:
    """Inverse frequencies [rotary_dim // 2], float32, matching transformers' rope init functions."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in ROPE_INIT:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {tuple(ROPE_INIT)}")
    if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return ROPE_INIT[rope_type](params, head_dim(config), config)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, head_dim // 2], computed once and indexed by each token's position."""

    def __init__(self, config) -> None:
        super().__init__()
        self.max_positions = config.max_position_embeddings
        self.config = config  # kept so the tables can be rebuilt after meta-device construction
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's own signature
        # `model.to(bfloat16)` casts buffers too; the tables stay float32, as transformers computes them (it
        # rounds cos/sin to the activations' dtype per step, forward() below; the fused CPU kernel does too).
        super()._apply(fn, recurse)
        self.cos, self.sin = self.cos.float(), self.sin.float()
        return self

    def _tables(self) -> tuple[Tensor, Tensor]:
        inv_freq = rope_inv_freq(self.config)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        params = rope_parameters(self.config)
        scale_fn = ROPE_TABLE_SCALE.get(params["rope_type"])
        scale = scale_fn(params, self.config) if scale_fn else 1.0
        return freqs.cos() * scale, freqs.sin() * scale

    @torch.no_grad()
    def reset_tables(self) -> None:
        """Refill the tables in place (after `to_empty`, which leaves buffers uninitialized)."""
        cos, sin = self._tables()
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [T, 1, D/2] for the step's tokens; looked up once per step, shared by all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def fused_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin float32 [T, D/2] for the fused CPU kernel, which rounds to the activations' dtype itself."""
        return self.cos[positions], self.sin[positions]


def apply_rope(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """x [T, heads, D] in the rotate-half (GPT-NeoX) layout that HF Llama checkpoints use."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
