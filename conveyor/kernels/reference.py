"""Pure-torch paged attention and KV-cache write: the truth every other backend is tested against.

Cache layout per layer: key_cache, value_cache = [num_blocks, block_size, num_kv_heads, head_dim].
Written for clarity, not speed: one sequence at a time.
"""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in a KV cache's dtype: round to nearest even; fp8 (no scales) saturates at its largest finite value
    (torch's own conversion does so for e4m3fn, and gives inf for e5m2)."""
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, KVH, D] into the caches at slot_mapping [T] (slot < 0: skip, a padding token)."""
    block_size = key_cache.shape[1]
    for t in range(key.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = to_cache_dtype(key[t], key_cache.dtype)
        value_cache[slot // block_size, slot % block_size] = to_cache_dtype(value[t], value_cache.dtype)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached positions of one sequence: [seq_len, KVH, D]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [n, block_size, KVH, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def first_visible_position(position: int, sliding_window: int | None) -> int:
    """The earliest key position a query at `position` attends: 0, or position - window + 1 with a window
    (transformers' sliding-window mask: key j is visible when position - window < j <= position)."""
    return 0 if sliding_window is None else max(0, position - sliding_window + 1)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, *, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of packed varlen queries [T, H, D] over each sequence's cached context.

    The q_len queries of sequence i are its last q_len positions, so query j (0-based) sits at position
    p = seq_len - q_len + j and attends to positions 0..p; with sliding_window W only to p - W < k <= p.
    logits_soft_cap c: scores = c * tanh(scale * q.k / c) before masking and softmax (Gemma 2).
    Only the blocks holding visible positions are read: the others may be freed or unmapped.
    Computed in float32; returns query's dtype.
    """
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for i in range(seq_lens.shape[0]):
        q_start, q_end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        q_len, seq_len = q_end - q_start, int(seq_lens[i])
        if q_len == 0:
            continue
        q = query[q_start:q_end].float()  # [q, H, D]
        block_size = key_cache.shape[1]
        first_block = first_visible_position(seq_len - q_len, sliding_window) // block_size
        start = first_block * block_size
        table = block_tables[i, first_block:]
        k = gather_context(key_cache, table, seq_len - start).float().repeat_interleave(group, dim=1)
        v = gather_context(value_cache, table, seq_len - start).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap is not None:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(start, seq_len, device=query.device).unsqueeze(0)
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
