"""Rotary position embeddings: the inverse-frequency variants transformers' checkpoints name in `rope_parameters`
(or `rope_theta` + `rope_scaling` in older configs), one cos/sin table per model, and the rotate-half rotation.

A variant is a function config-params -> inv_freq [rotary_dim // 2] in float32, registered in ROPE_INIT; the
tables are built once and indexed by each token's position, so a variant costs nothing per step. rotary_dim is
head_dim unless the family rotates only part of each head (Phi-4-mini's partial_rotary_factor): Llama, Qwen,
Gemma and Mixtral rotate whole heads whatever the config says, as transformers' rotaries for them do."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; older configs: rope_theta + rope_scaling.
    layer_type: the entry of a config whose `rope_parameters` is keyed by layer type (Gemma 3:
    "sliding_attention", "full_attention"); a flat one is shared by every layer type."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    scaling = getattr(config, "rope_scaling", None)
    if scaling and "rope_type" not in params:
        params.update(scaling)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def original_max_positions(params: dict, config) -> int:
    """The pretraining context a scaled rope stretches: the config's own field first (Phi-3 keeps it there, and
    transformers gives it priority), then the rope parameters', then max_position_embeddings."""
    return (getattr(config, "original_max_position_embeddings", None) or params.get("original_max_position_embeddings")
            or config.max_position_embeddings)


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


def _yarn_factor(params: dict, config) -> float:
    return params.get("factor") or config.max_position_embeddings / original_max_positions(params, config)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict, dim: int, config) -> Tensor:
    """YaRN: frequencies interpolated by `factor` below a band of dimensions, kept above it, a linear ramp between
    (transformers' _compute_yarn_parameters)."""
    base, factor = params["rope_theta"], _yarn_factor(params, config)
    old_len = original_max_positions(params, config)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    keep = 1 - ramp  # the share of each frequency kept as it was trained (extrapolated)
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def _yarn_scale(params: dict, config) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, mscale, mscale_all_dim = _yarn_factor(params, config), params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def longrope_uses_long_factors(params: dict, config) -> bool:
    """Whether LongRoPE's long factors rotate every position. transformers picks per forward, by the sequence's
    length so far: without a cache a sequence past the pretraining context is rotated long throughout, with one
    its earlier keys keep the short rotation. A cache shared across steps and requests needs one rotation per
    position, so the choice is made once, by the context the engine serves (as vLLM does): long when
    max_model_len (params, set by the engine; else max_position_embeddings) exceeds the original context. Within
    the original context every sequence then gets transformers' exact (short) rotation."""
    served = params.get("max_model_len") or config.max_position_embeddings
    return served > original_max_positions(params, config)


def _longrope(params: dict, dim: int, config) -> Tensor:
    """Phi-3's LongRoPE: each frequency divided by its own factor, the short or the long list."""
    factors = params["long_factor"] if longrope_uses_long_factors(params, config) else params["short_factor"]
    factors = torch.tensor(factors, dtype=torch.float32, device="cpu")
    if factors.shape != (dim // 2,):
        raise ValueError(f"longrope factors have {factors.numel()} entries; head_dim {dim} needs {dim // 2}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (factors * params["rope_theta"] ** shape)


def _longrope_scale(params: dict, config) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    old_len = original_max_positions(params, config)
    factor = params.get("factor") or config.max_position_embeddings / old_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


# rope_type -> inv_freq function. Variants that also scale the tables (YaRN's attention factor, LongRoPE's) return
# that factor through ROPE_TABLE_SCALE.
ROPE_INIT: dict[str, Callable[[dict, int, object], Tensor]] = {
    "default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn, "longrope": _longrope,
}
ROPE_TABLE_SCALE: dict[str, Callable[[dict, object], float]] = {"yarn": _yarn_scale, "longrope": _longrope_scale}


def partial_rotary_dim(config, params: dict) -> int:
    """The leading dims of each head that rotate, for families that honour partial_rotary_factor (Phi-3's
    config class; older configs keep the factor at the top level)."""
    factor = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    dim = int(head_dim(config) * factor)
    if not 0 < dim <= head_dim(config) or dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotary dims of head_dim {head_dim(config)}; "
                         "it needs an even number in (0, head_dim]")
    return dim


def rope_inv_freq(config, params: dict | None = None, dim: int | None = None) -> Tensor:
    """Inverse frequencies [dim // 2], float32, matching transformers' rope init functions.
    params: the rope parameters to use (default: the config's, rope_parameters()); dim: rotary dims (head_dim)."""
    params = rope_parameters(config) if params is None else params
    rope_type = params["rope_type"]
    if rope_type not in ROPE_INIT:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {tuple(ROPE_INIT)}")
    return ROPE_INIT[rope_type](params, dim or head_dim(config), config)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, rotary_dim // 2], computed once and indexed by each token's position.
    params: rope parameters other than the config's own (a layer type's, in Gemma 3); rotary_dim: the leading dims
    of each head that rotate (default head_dim)."""

    def __init__(self, config, params: dict | None = None, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.max_positions = config.max_position_embeddings
        self.config = config  # kept so the tables can be rebuilt after meta-device construction
        self.params = dict(rope_parameters(config) if params is None else params)
        self.rotary_dim = rotary_dim or head_dim(config)
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
        params = self.params
        inv_freq = rope_inv_freq(self.config, params, self.rotary_dim)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        scale_fn = ROPE_TABLE_SCALE.get(params["rope_type"])
        scale = scale_fn(params, self.config) if scale_fn else 1.0
        return freqs.cos() * scale, freqs.sin() * scale

    @torch.no_grad()
    def reset_tables(self, max_model_len: int | None = None) -> None:
        """Refill the tables in place (after `to_empty`, which leaves buffers uninitialized).
        max_model_len: the context the engine serves (it picks LongRoPE's factors: longrope_uses_long_factors)."""
        if max_model_len is not None:
            self.params["max_model_len"] = min(max_model_len, self.max_positions)
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
    """x [T, heads, D] in the rotate-half (GPT-NeoX) layout that HF Llama checkpoints use. Tables narrower than
    D/2 rotate the first 2 * width dims and pass the rest through (partial rotary)."""
    cos, sin = rope
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary_dim], rope), x[..., rotary_dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
