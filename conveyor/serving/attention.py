"""Per-step attention metadata and the attention layer that reads it."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.kernels import ops


@dataclass
class AttentionMetadata:
    """Describes one packed, variable-length step (prefill chunks and decodes together).

    Tokens of sequence i occupy rows query_start_loc[i]:query_start_loc[i+1] of the packed batch, and are the
    last (query_start_loc[i+1] - query_start_loc[i]) positions of its context of seq_lens[i] tokens.
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset for each new token
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length including this step's tokens
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends that loop over sequences need no device sync.
    seq_lens_list: list[int] | None = None
    query_lens_list: list[int] | None = None
    # The runner zero-fills the cache, so unused slots are finite and backends may skip masking them.
    finite_cache: bool = False
    # ops.cpu_step_plan for this step, made by the first layer that wants it and reused by the others.
    cpu_plan: ops.CpuStepPlan | None = None


def uniform_sliding_window(model: torch.nn.Module) -> int | None:
    """The sliding window every attention layer of model shares, or None where some layer attends the whole
    context (or the layers' windows differ): only then can the KV cache free blocks behind the window."""
    windows = {m.sliding_window for m in model.modules() if isinstance(m, PagedAttention)}
    return windows.pop() if len(windows) == 1 else None


class PagedAttention(torch.nn.Module):
    """Paged attention with its options: scale (default head_dim ** -0.5), sliding_window (a query at position p
    attends keys p - window < j <= p, as transformers' sliding-window mask) and logits_soft_cap (scores =
    cap * tanh(scores / cap) before the mask, as Gemma 2). ValueError at construction for an option out of
    range or one the backend cannot honour."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str = "torch", *,
                 scale: float | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        ops.check_options(backend, sliding_window, logits_soft_cap)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else float(scale)
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
        self.backend = backend

    def set_sliding_window(self, sliding_window: int | None) -> None:
        """Change the window after construction (a family that learns each layer's window from its index)."""
        ops.check_options(self.backend, sliding_window, self.logits_soft_cap)
        self.sliding_window = None if sliding_window is None else int(sliding_window)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """query [T, H*D], key/value [T, KVH*D] -> output [T, H*D]; writes key/value into kv_cache first."""
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_dim)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        ops.write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping, backend=self.backend)
        if meta.cpu_plan is None and ops.uses_cpu_plan(self.backend, meta.max_query_len):
            meta.cpu_plan = ops.cpu_step_plan(meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                              meta.query_lens_list, meta.seq_lens_list)
        out = ops.paged_attention(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
            seq_lens_list=meta.seq_lens_list, query_lens_list=meta.query_lens_list, backend=self.backend,
            finite_cache=meta.finite_cache, plan=meta.cpu_plan, sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
