"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral, Qwen2, Qwen3) in plain torch on paged attention.

Tokens arrive packed: one flat [T] batch holding prefill chunks and decodes of many sequences together; the
attention layer finds each sequence's rows and cached context through AttentionMetadata. Everything except
attention is per-token, so it needs no notion of sequences at all.

q/k/v and gate/up are fused into one Linear each at load time: fewer, larger matmuls suit a slow CPU.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from conveyor.kernels import cpu_fused
from conveyor.serving.attention import AttentionMetadata, PagedAttention
from conveyor.serving.models.cpu_packing import PackedLinear, pack_linears

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
QK_NORM_MODEL_TYPES = ("qwen3",)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_parameters(config) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; older configs: rope_theta + rope_scaling."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    scaling = getattr(config, "rope_scaling", None)
    if scaling and "rope_type" not in params:
        params.update(scaling)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config) -> Tensor:
    """Inverse frequencies [head_dim // 2], float32, matching transformers' rope init functions."""
    params = _rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    dim = _head_dim(config)
    # On the CPU even inside a meta-device build: meta arithmetic runs torch's Python references, which import
    # torch._dynamo (~2 s of a replica's start on 2 cores).
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    return inv_freq


def _llama3_scale(inv_freq: Tensor, params: dict) -> Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


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
        return freqs.cos(), freqs.sin()

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


class Attention(nn.Module):
    def __init__(self, config, backend: str, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.head_dim = _head_dim(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Qwen2 always has q/k/v bias; Llama has it when attention_bias is set.
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias and config.model_type != "qwen2")
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, backend=backend)
        # Qwen3 normalizes every query and key head (RMSNorm over head_dim) before the rotary embedding.
        self.has_qk_norm = config.model_type in QK_NORM_MODEL_TYPES
        if self.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, rope: tuple[Tensor, Tensor], x: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> Tensor:
        qkv = self.qkv_proj(x)
        if self.has_qk_norm:
            qkv = self._norm_heads(qkv)
        if self.fused:
            # q and k heads are adjacent in each qkv row: one in-place call rotates both.
            cpu_fused.rotary_embedding_neox(qkv, *rope, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if not self.fused:
            q = apply_rope(q.view(-1, self.num_heads, self.head_dim), rope).reshape(-1, self.q_size)
            k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), rope).reshape(-1, self.kv_size)
        out = self.attn(q, k, v, kv_cache, meta)
        return self.o_proj(out)

    def _norm_heads(self, qkv: Tensor) -> Tensor:
        """qkv with each query and key head RMS-normalized, in the same [T, q + k + v] layout (so the fused rope
        still rotates q and k in one call)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).flatten(1)
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).flatten(1)
        return torch.cat((q, k, v), dim=-1)


class MLP(nn.Module):
    """fused: the activation is one C++ pass (conveyor/kernels/cpu_fused.py), not silu then mul."""

    def __init__(self, config, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        bias = bool(getattr(config, "mlp_bias", False))
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only silu")
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if self.fused:
            return self.down_proj(cpu_fused.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Carries the residual stream separately (vLLM style), so each norm can fold in the residual add."""

    def __init__(self, config, backend: str, fused: bool = False) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend, fused)
        self.mlp = MLP(config, fused)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)

    def forward(self, rope: tuple[Tensor, Tensor], x: Tensor, residual: Tensor | None,
                kv_cache: tuple[Tensor, Tensor], meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it); residual None: first layer."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, backend: str) -> None:
        super().__init__()
        # The "cpu" attention backend means our C++ CPU extension is built: its fused norm and rope come along.
        self.fused = backend == "cpu" and cpu_fused.is_available()
        # Given its weight, nn.Embedding skips its random init: on the meta device that init imports torch._dynamo
        # (2 s of a replica's start on 2 cores), for values the checkpoint overwrites anyway.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.rotary_emb = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, self.fused)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.fused)


# HF per-projection name -> (our fused parameter, index of its shard in the fused output rows).
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, attention_backend: str = "torch") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attention_backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied: logits reuse embed_tokens.weight directly, so no second parameter exists to untie by accident.
        self.packed_logits: nn.Module | None = None  # PackedLinear, or a GGUFLinear around one
        self.decode_stack = None  # models.decode_stack.DecodeStack, set by the engine where it applies
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                       bias=False)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                meta: AttentionMetadata) -> Tensor:
        """Packed varlen tokens input_ids/positions int64 [T] -> final hidden states [T, hidden_size]."""
        x = self.model.embed_tokens(input_ids)
        rotary = self.model.rotary_emb
        rope = rotary.fused_tables(positions) if self.model.fused else rotary(positions, x.dtype)
        if self.decode_stack is not None and self.decode_stack.handles(x.shape[0], meta):
            return self.decode_stack(x, rope, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(rope, x, residual, kv_cache, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, hidden] -> float32 [N, vocab]. Callers pass only the rows they sample from."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.packed_logits is not None:
            return self.packed_logits(hidden).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    def pack_for_cpu(self) -> int:
        """Re-lay every projection out for oneDNN (see cpu_packing.py); returns the number packed.
        Tied logits get their own packed copy: the embedding lookup still needs the plain table."""
        count = pack_linears(self, (self.model.embed_tokens.weight.dtype,))
        if self.lm_head is None:
            self.packed_logits = PackedLinear(self.model.embed_tokens.weight, None)
            count += 1
        return count

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; raises on unknown or missing names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue  # recomputed / tied to the embedding
            target, rows = self._target(name, params)
            dest = target[rows]
            if dest.shape != tensor.shape:  # copy_ would broadcast silently
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(self._fused_name(name))
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")

    @staticmethod
    def _fused_name(name: str) -> str:
        for hf, (ours, _) in _FUSED.items():
            if f".{hf}." in name:
                return name.replace(f".{hf}.", f".{ours}.")
        return name

    def _target(self, name: str, params: dict[str, Tensor]) -> tuple[Tensor, slice]:
        """The parameter an HF tensor lands in, and which rows of it (a slice for fused projections)."""
        ours = self._fused_name(name)
        if ours not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        param = params[ours]
        if ours == name:
            return param, slice(None)
        shard = next(idx for hf, (_, idx) in _FUSED.items() if f".{hf}." in name)
        attn = self.model.layers[0].self_attn
        sizes = ([attn.q_size, attn.kv_size, attn.kv_size] if ".qkv_proj." in ours
                 else [self.config.intermediate_size] * 2)
        start = sum(sizes[:shard])
        return param, slice(start, start + sizes[shard])
