"""Triton kernels: varlen paged attention for a mixed step (prefill chunks + decodes) and the KV-cache write.

One attention program handles one (sequence, kv head, tile of query tokens): its rows are the tile's query
tokens
times the query heads of that kv head's GQA group, so every K/V tile is read once for the whole group. It
walks
the sequence's context in BLOCK_N-position tiles, looking each position's block up in the block table (so any
power-of-two block size works, including block sizes smaller than the tile), with an fp32 online softmax.

Options: with a sliding window (window > 0) a row at position p attends (p - window, p], and a program starts its
walk at its first row's first visible position, so blocks wholly before the window are never read; logit
soft-capping (soft_cap > 0) turns scores into soft_cap * tanh(scores / soft_cap) before the softmax.

Under TRITON_INTERPRET=1 (CPU tests) operands are upcast to fp32 right after loading: the interpreter's bf16
arithmetic is wrong. On a GPU, bf16/fp16 operands go to tl.dot natively (tensor cores, fp32 accumulation) and
fp32 operands use IEEE precision rather than tf32, so fp32 checks stay tight.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel uses exp2
    window,  # sliding window (positions), used when HAS_WINDOW
    soft_cap,  # logit soft cap * log2(e), used when HAS_SOFT_CAP
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_M: tl.constexpr,  # query tokens per program; rows = BLOCK_M * GROUP_PAD
    BLOCK_N: tl.constexpr,  # context positions per inner step
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # cache block size (power of two)
    COMPUTE_DTYPE: tl.constexpr,  # dtype fed to tl.dot
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    tile_start = tile * BLOCK_M
    if tile_start >= q_len:  # grid is sized for the longest query; shorter ones leave programs idle
        return
    context_start = seq_len - q_len  # position of this sequence's first query token

    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    tok = tile_start + rows // GROUP_PAD  # query token index within the sequence
    grp = rows % GROUP_PAD
    head = kv_head * GROUP + grp  # reference order: query head h uses kv head h // GROUP
    row_ok = (tok < q_len) & (grp < GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(COMPUTE_DTYPE)
    q_pos = context_start + tok  # causal limit per row

    # Finite start for the running max: fully masked rows (padding rows) then give exp2(-inf) = 0, not NaN.
    m_i = tl.full([BLOCK_M * GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], dtype=tl.float32)

    # The last row of the tile sees positions up to context_start + its token: no later position is needed.
    last_tok = tl.minimum(tile_start + BLOCK_M, q_len)
    kv_end = context_start + last_tok
    kv_start = 0
    if HAS_WINDOW:  # the first row sees nothing before its window: neither do the others
        kv_start = tl.maximum(context_start + tile_start - window + 1, 0)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(kv_start, kv_end, BLOCK_N):
        pos = start_n + offs_n
        pos_ok = pos < kv_end  # never past seq_len, so the block-table column is in range
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        slot_in_block = pos % BLOCK_SIZE
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k_ptrs = (k_cache_ptr + block.to(tl.int64)[:, None] * stride_kb + slot_in_block[:, None] * stride_ks
                  + kv_head * stride_kh + offs_d[None, :])
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_SOFT_CAP:
            # Scores and soft_cap are both in log2 units (times log2(e)), where c * tanh(s / c) is the same map.
            # tanh(y) = 1 - 2 / (exp(2y) + 1): exact at both ends (exp overflows to inf: 1; underflows to 0: -1).
            scores = soft_cap * (1.0 - 2.0 / (tl.exp(scores * (2.0 / soft_cap)) + 1.0))
        causal = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        if HAS_WINDOW:
            causal = causal & (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(causal, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptrs = (v_cache_ptr + block.to(tl.int64)[:, None] * stride_vb + slot_in_block[:, None] * stride_vs
                  + kv_head * stride_vh + offs_d[None, :])
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(COMPUTE_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows: never stored, but keep them finite
    out = acc / l_safe[:, None]
    o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copy its [KVH, D] key and value rows into their cache slot."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    if slot < 0:  # padding token: nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    row = offs_h[:, None] * stride_kch + offs_d[None, :]
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kcs + row
    v_row = offs_h[:, None] * stride_vch + offs_d[None, :]
    vc = v_cache_ptr + block * stride_vcb + offset * stride_vcs + v_row
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _compute_dtype(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """The dtype tl.dot sees and its precision mode (see the module docstring for why)."""
    if _INTERPRET or dtype not in (torch.bfloat16, torch.float16):
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"  # precision unused for 16-bit


def _check_inner_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("triton paged attention needs a contiguous last (head_dim) dimension")


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, *, max_query_len: int, max_seq_len: int,
                    seq_lens_list: list[int] | None = None, query_lens_list: list[int] | None = None,
                    block_m: int | None = None, block_n: int | None = None,
                    out: torch.Tensor | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """Same contract as reference.paged_attention; the *_list args are accepted for the ops signature only."""
    del max_seq_len, seq_lens_list, query_lens_list  # the kernel reads lengths on the device
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if block_size & (block_size - 1):
        raise ValueError(f"block size {block_size} is not a power of two")
    _check_inner_contiguous(query, key_cache, value_cache)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Rows per program = tokens * group_pad; at least 16 so tl.dot has legal shapes on a GPU. A decode-only
    # step uses one token per program (no wasted rows beyond the 16-row minimum).
    if block_m is None:
        rows = 16 if max_query_len == 1 else 64
        block_m = max(1, max(rows, group_pad) // group_pad)
    block_m = min(block_m, triton.next_power_of_2(max_query_len))
    if block_m * group_pad < 16:
        block_m = triton.next_power_of_2(triton.cdiv(16, group_pad))
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    compute_dtype, precision = _compute_dtype(query.dtype)
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_m))
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out, block_tables, seq_lens, query_start_loc,
        scale * _LOG2E, sliding_window or 0, (logits_soft_cap or 0.0) * _LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        COMPUTE_DTYPE=compute_dtype, DOT_PRECISION=precision,
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=logits_soft_cap is not None,
    )
    return out


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, KVH, D] into the caches at slot_mapping [T]; slot < 0 is a padding token."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_inner_contiguous(key, value, key_cache, value_cache)
    block_size = key_cache.shape[1]
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
    )
