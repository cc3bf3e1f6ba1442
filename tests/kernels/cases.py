"""Random paged-attention inputs shared by the kernel tests and benchmarks/gpu_check.py."""
from __future__ import annotations

import dataclasses
import math

import torch

# Block-table columns past a sequence's last block get this value: any kernel that reads them goes out of
# bounds
# (an IndexError in torch on CPU, a memory fault or garbage on a GPU) instead of silently passing.
BAD_BLOCK = 1 << 30


@dataclasses.dataclass
class PagedCase:
    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    scale: float
    seq_lens_list: list[int]
    query_lens_list: list[int]
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)

    def kwargs(self) -> dict:
        return {"max_query_len": max(self.query_lens_list, default=0),
                "max_seq_len": max(self.seq_lens_list, default=0),
                "seq_lens_list": self.seq_lens_list, "query_lens_list": self.query_lens_list,
                **{k: v for k, v in self.options().items() if v is not None}}

    def options(self) -> dict:
        """The attention options (the reference takes these keywords too)."""
        return {"sliding_window": self.sliding_window, "logits_soft_cap": self.logits_soft_cap}

    def to(self, dtype: torch.dtype) -> PagedCase:
        """The same case with query and caches cast (e.g. float64 for a reference)."""
        return dataclasses.replace(self, query=self.query.to(dtype), key_cache=self.key_cache.to(dtype),
                                   value_cache=self.value_cache.to(dtype))


def make_case(specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              seed: int = 0, spare_blocks: int = 3, poison_tail: bool = True, sliding_window: int | None = None,
              logits_soft_cap: float | None = None) -> PagedCase:
    """specs: (q_len, seq_len) per sequence; q_len == 1 is a decode, q_len == seq_len a fresh prefill.

    Blocks are handed out in a random order. Cache positions past each seq_len (the tail of its last block,
    and spare blocks) hold NaN when poison_tail, so a kernel that lets them reach its output fails. With a
    sliding window, table entries of blocks wholly before the first query's window are BAD_BLOCK (as the engine
    frees them): a kernel that reads them fails. logits_soft_cap: scores also scaled up so the cap bites.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for _, s in specs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    if poison_tail:
        written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq, default=0) + 1  # one spare column: always padding
    tables = torch.full((len(specs), max_blocks), BAD_BLOCK, dtype=torch.int32)
    used = 0
    for i, ((_, seq_len), n) in enumerate(zip(specs, blocks_per_seq, strict=True)):
        tables[i, :n] = perm[used:used + n].int()
        used += n
        if poison_tail:
            for p in range(seq_len):
                written[int(tables[i, p // block_size]) * block_size + p % block_size] = True
    if poison_tail:
        key_cache.view(-1, num_kv_heads, head_dim)[~written] = float("nan")
        value_cache.view(-1, num_kv_heads, head_dim)[~written] = float("nan")
    q_lens = [q for q, _ in specs]
    seq_lens = [s for _, s in specs]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen)
    if logits_soft_cap is not None:
        query *= 4.0  # scores of several times the cap: without it the tanh is nearly linear
    if sliding_window is not None:
        for i, (q_len, seq_len) in enumerate(specs):
            dead_positions = max(0, seq_len - q_len - sliding_window + 1)  # keys before the first query's window
            tables[i, :dead_positions // block_size] = BAD_BLOCK
    return PagedCase(
        query=query.to(device=device, dtype=dtype),
        key_cache=key_cache.to(device=device, dtype=dtype),
        value_cache=value_cache.to(device=device, dtype=dtype),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=head_dim ** -0.5,
        seq_lens_list=seq_lens,
        query_lens_list=q_lens,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )


def make_kv_write(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
                  skip_every: int = 3) -> tuple[torch.Tensor, ...]:
    """key, value [T, KVH, D], random caches and distinct slots; every skip_every-th token has slot -1."""
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].long()
    if skip_every:
        slots[::skip_every] = -1
    return tuple(t.to(device=device, dtype=dtype) for t in (key, value, key_cache, value_cache)) + (
        slots.to(device),)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf (never passes a tolerance)."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


# Tolerances on rel_err: fp32 arithmetic lands far under 1e-4; bf16 operands between 1e-3 and 1e-2.
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}

# (q_len, seq_len) mixes: decodes, a fresh prefill, chunks whose first token sits inside a block (context 6
# with
# block 4: the chunk starts mid-block), an idle sequence (q_len 0), ragged lengths.
MIXED_SPECS = [(1, 7), (5, 5), (3, 9), (1, 1), (0, 4), (4, 13)]
DECODE_SPECS = [(1, 7), (1, 1), (1, 16), (1, 33), (1, 5)]

# Windows against MIXED_SPECS / DECODE_SPECS and WINDOW_SPECS: shorter than a block, a few blocks, and longer
# than every context (no position hidden).
WINDOWS = [3, 8, 64]
# Long contexts where the window hides most of the context, in decode and chunked prefill.
WINDOW_SPECS = [(1, 40), (6, 37), (17, 17), (1, 9), (12, 50), (0, 20)]
