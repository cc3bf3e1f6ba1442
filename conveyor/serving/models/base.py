"""What every decoder-only family shares around its layers: the step's forward over packed tokens, logits, CPU
packing and loading checkpoint tensors by their Hugging Face names into our (partly fused) parameters.

A family subclasses CausalLM, builds `self.model` with `embed_tokens`, `rotary_emb`, `layers` and `norm`, and
names the checkpoint projections it fuses in FUSED_SHARDS; each layer is called as
`layer(rope, x, residual, kv_cache, meta) -> (x, residual)` with the residual stream carried separately (vLLM
style), so each norm can fold in the residual add.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from conveyor.serving.attention import AttentionMetadata
from conveyor.serving.models.cpu_packing import PackedLinear, pack_linears

# HF per-projection name -> (our fused parameter, index of its shard in the fused output rows). The module that
# owns the fused parameter says how many rows each shard has (its shard_sizes()).
LLAMA_FUSED_SHARDS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class CausalLM(nn.Module):
    FUSED_SHARDS: dict[str, tuple[str, int]] = LLAMA_FUSED_SHARDS
    # Whether gguf_weights.py maps llama.cpp's layout of this family's linears (q/k row order, fused tensors).
    GGUF_BLOCKS = True
    # Checkpoint tensors under these prefixes are never read (parts of a multimodal checkpoint that do not run).
    SKIPPED_PREFIXES: tuple[str, ...] = ()
    model: nn.Module

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied: logits reuse embed_tokens.weight directly, so no second parameter exists to untie by accident.
        self.packed_logits: nn.Module | None = None  # PackedLinear, or a GGUFLinear around one
        self.decode_stack = None  # models.decode_stack.DecodeStack, set by the engine where it applies
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                       bias=False)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                meta: AttentionMetadata) -> Tensor:
        """Packed varlen tokens input_ids/positions int64 [T] -> final hidden states [T, hidden_size]."""
        x = self.embed(input_ids)
        rope = self.rope(positions, x.dtype)
        if self.decode_stack is not None and self.decode_stack.handles(x.shape[0], meta):
            return self.decode_stack(x, rope, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(rope, x, residual, kv_cache, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def rope(self, positions: Tensor, dtype: torch.dtype):  # noqa: ANN201 - whatever the family's layers take
        """The step's rotary tables, looked up once for every layer: (cos, sin). A family whose layers differ
        (Gemma 3's local and global rope bases) returns what its layers pick from."""
        rotary = self.model.rotary_emb
        return rotary.fused_tables(positions) if self.model.fused else rotary(positions, dtype)

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

    def skip_weight(self, name: str) -> bool:
        """Checkpoint tensors we recompute or tie rather than load."""
        return "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.lm_head is None)

    def checkpoint_weights(self, weights: Iterable[tuple[str, Tensor]]) -> Iterable[tuple[str, Tensor]]:
        """The checkpoint's (name, tensor) pairs as this class names them; a family renames or splits here."""
        return weights

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; raises on unknown or missing names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in self.checkpoint_weights(weights):
            if self.skip_weight(name):
                continue
            target, rows = self._target(name, params)
            dest = target[rows]
            if dest.shape != tensor.shape:  # copy_ would broadcast silently
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(self._fused_name(name))
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")

    def _fused_name(self, name: str) -> str:
        for hf, (ours, _) in self.FUSED_SHARDS.items():
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
        shard = next(idx for hf, (_, idx) in self.FUSED_SHARDS.items() if f".{hf}." in name)
        owner = self.get_submodule(ours.rsplit(".", 2)[0])  # "...self_attn.qkv_proj.weight" -> "...self_attn"
        sizes = owner.shard_sizes()
        start = sum(sizes[:shard])
        return param, slice(start, start + sizes[shard])
