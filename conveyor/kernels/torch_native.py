"""Vectorized torch paged attention: the CPU default backend (the reference is too slow to serve with).

Decode-only sequences (one query token each) are batched into one padded, grouped matmul: on CPU the per-
sequence
Python loop and its small SDPA calls cost more than the arithmetic. Sequences with a prefill chunk (q_len > 1)
still go one at a time through SDPA with a causal mask, since their shapes differ too much to pad cheaply.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.kernels.reference import FP8_DTYPES, first_visible_position, to_cache_dtype


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, KVH, D] into the caches at slot_mapping [T]; slot < 0 is a padding token. Rows
    convert to the cache's dtype where it differs (a bf16 or fp8 cache for an fp32 model)."""
    key, value = to_cache_dtype(key, key_cache.dtype), to_cache_dtype(value, value_cache.dtype)
    if key_cache.dtype in FP8_DTYPES:  # torch's CPU index_copy_ has no fp8 kernel: move the bytes
        key, value = key.view(torch.uint8), value.view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    if slot_mapping.numel() and int(slot_mapping.min()) >= 0:
        # No padding (the usual case): index_copy_ is ~5x cheaper than boolean-mask indexing on CPU.
        key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)
        return
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[valid]
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[valid]


# Gathered K (and V) bytes per chunk of decode sequences. Measured on the 2-core CPU VM (32 decodes of context
# 300, H=9, KVH=3, D=64): temporaries of several MB are returned to the OS and page-faulted back on every call,
# which made one whole-batch gather slower than the old per-sequence loop; ~1 MB chunks run 2x faster than it.
_CHUNK_BYTES = 1 << 20


def _decode_batch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens_list: list[int], scale: float,
                  finite_cache: bool = False, sliding_window: int | None = None,
                  logits_soft_cap: float | None = None) -> torch.Tensor:
    """Attention for B single-token queries [B, H, D] at once; returns [B, H, D] in query's dtype.

    With a sliding window each sequence's gather starts at the block holding its first visible position, so
    blocks before the window are never read (they may be freed)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    device = query.device
    lens = torch.tensor(seq_lens_list, dtype=torch.long, device=device)
    used = (lens + block_size - 1) // block_size
    if sliding_window is None:
        first = torch.zeros_like(lens)
    else:
        first = (lens - sliding_window).clamp_min(0) // block_size
    num_blocks = int((used - first).max())
    padded_len = num_blocks * block_size
    # Table entries past a sequence's last block may be stale or padding: point them at block 0 so the
    # gather stays in bounds; the positions they yield are masked out below.
    cols = first.unsqueeze(1) + torch.arange(num_blocks, device=device).unsqueeze(0)  # [B, nb]
    inside = cols < used.unsqueeze(1)
    tables = block_tables.long().gather(1, torch.where(inside, cols, torch.zeros_like(cols)))
    tables = torch.where(inside, tables, torch.zeros_like(tables))
    positions = first.unsqueeze(1) * block_size + torch.arange(padded_len, device=device).unsqueeze(0)  # [B, S]
    pad = positions >= lens.unsqueeze(1)
    hidden = pad if sliding_window is None else pad | (positions <= (lens - 1 - sliding_window).unsqueeze(1))
    # Compute in at least fp32 like the reference (bf16 matmuls are also very slow on CPU).
    dtype = torch.promote_types(query.dtype, torch.float32)
    out = torch.empty(batch, num_heads, head_dim, dtype=dtype, device=device)
    seq_bytes = padded_len * num_kv_heads * head_dim * dtype.itemsize
    chunk = max(1, _CHUNK_BYTES // seq_bytes)
    for c in range(0, batch, chunk):
        n = min(chunk, batch - c)
        k = _gather(key_cache, tables[c:c + n], dtype)  # [n * KVH, S, D]
        v = _gather(value_cache, tables[c:c + n], dtype)
        if not finite_cache:
            # Padded positions get probability 0, but 0 * NaN is NaN: stale cache slots may hold anything.
            # (A tenth of a SmolLM2 decode step on CPU: the engine zero-fills its cache and skips this.)
            v.view(n, num_kv_heads, padded_len, head_dim).masked_fill_(pad[c:c + n, None, :, None], 0.0)
        # Query heads h = kvh * group + g share kv head kvh (the reference's repeat_interleave order).
        q = query[c:c + n].reshape(n * num_kv_heads, group, head_dim).to(dtype)
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale).view(n, num_kv_heads, group, padded_len)
        if logits_soft_cap is not None:
            scores = scores.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
        scores.masked_fill_(hidden[c:c + n, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(n * num_kv_heads, group, padded_len)
        out[c:c + n] = torch.bmm(probs, v).view(n, num_heads, head_dim)
    return out.to(query.dtype)


def _gather(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks of tables [n, nb] as one contiguous [n * KVH, nb * block_size, D] tensor (one copy)."""
    n, num_blocks = tables.shape
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    blocks = cache.index_select(0, tables.flatten()).view(n, num_blocks * block_size, num_kv_heads, head_dim)
    return blocks.transpose(1, 2).to(dtype).reshape(n * num_kv_heads, num_blocks * block_size, head_dim)


def _prefill_one(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 table: torch.Tensor, seq_len: int, scale: float, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> torch.Tensor:
    """Causal attention of one sequence's q_len queries [q, H, D] over its context; returns [q, H, D]. Blocks
    wholly before the first query's window are not read."""
    q_len = query.shape[0]
    block_size = key_cache.shape[1]
    first_block = first_visible_position(seq_len - q_len, sliding_window) // block_size
    start = first_block * block_size
    num_blocks = (seq_len + block_size - 1) // block_size
    table = table[first_block:num_blocks].long()
    # SDPA wants one dtype: a cache narrower than the model is widened to the query's.
    k = key_cache.index_select(0, table).flatten(0, 1)[:seq_len - start].transpose(0, 1).to(query.dtype)
    v = value_cache.index_select(0, table).flatten(0, 1)[:seq_len - start].transpose(0, 1).to(query.dtype)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
    k_pos = torch.arange(start, seq_len, device=query.device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    if logits_soft_cap is not None:
        return _soft_capped(query, k, v, mask, scale, logits_soft_cap)
    # enable_gqa lets SDPA share each KV head across its query group instead of materializing the repeats:
    # at a 2k context that halves the cost of a prefill chunk's attention on CPU.
    o = F.scaled_dot_product_attention(query.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _soft_capped(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                 cap: float) -> torch.Tensor:
    """Attention with cap * tanh(scores / cap) between the product and the mask (SDPA has no such hook).
    query [q, H, D], k/v [KVH, S, D], mask [q, S] -> [q, H, D]."""
    num_kv_heads = k.shape[0]
    group = query.shape[1] // num_kv_heads
    dtype = torch.promote_types(query.dtype, torch.float32)
    q = query.transpose(0, 1).reshape(num_kv_heads, group * query.shape[0], -1).to(dtype)  # [KVH, g*q, D]
    scores = torch.bmm(q, k.to(dtype).transpose(1, 2)).mul_(scale).div_(cap).tanh_().mul_(cap)
    scores = scores.view(num_kv_heads, group, query.shape[0], -1).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * query.shape[0], -1)
    out = torch.bmm(probs, v.to(dtype)).view(query.shape[1], query.shape[0], -1)
    return out.transpose(0, 1).to(query.dtype)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, seq_lens_list: list[int] | None = None,
                    query_lens_list: list[int] | None = None, finite_cache: bool = False,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Same contract as reference.paged_attention; the *_list args spare a device sync when given."""
    options = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
    if seq_lens_list is None:
        seq_lens_list = seq_lens.tolist()
    if query_lens_list is None:
        query_lens_list = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    out = torch.empty_like(query)
    starts = [0] * len(query_lens_list)
    for i in range(1, len(query_lens_list)):
        starts[i] = starts[i - 1] + query_lens_list[i - 1]
    decode = [i for i, q_len in enumerate(query_lens_list) if q_len == 1]
    if len(decode) == len(query_lens_list) and decode:
        # Pure decode step: query rows are already the batch, in order.
        out.copy_(_decode_batch(query, key_cache, value_cache, block_tables, seq_lens_list, scale, finite_cache,
                                **options))
        return out
    if len(decode) >= 2:  # a lone decode row is cheaper through SDPA than through the padded batch
        rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=query.device)
        index = torch.tensor(decode, dtype=torch.long, device=query.device)
        out[rows] = _decode_batch(query[rows], key_cache, value_cache, block_tables[index],
                                  [seq_lens_list[i] for i in decode], scale, finite_cache, **options)
        decode_set = set(decode)
    else:
        decode_set = set()
    for i, (q_len, seq_len) in enumerate(zip(query_lens_list, seq_lens_list, strict=True)):
        if q_len == 0 or i in decode_set:
            continue
        start = starts[i]
        out[start:start + q_len] = _prefill_one(query[start:start + q_len], key_cache, value_cache,
                                                block_tables[i], seq_len, scale, **options)
    return out
