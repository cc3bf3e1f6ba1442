"""How backend "cpu" splits a step with prefill chunks between its two C++ kernels, planned once per step.

- The decode kernel (csrc/cpu/paged_attention_cpu.cpp) takes every decode row and every row of a chunk of at
  most MAX_CHUNK_AS_DECODE_ROWS tokens: row j of a q-token chunk whose context ends at s is a decode over the
  first s - q + 1 + j tokens (causal).
- The prefill kernel (csrc/cpu/prefill_attention_cpu.cpp) takes the longer chunks, in one call: each K/V tile it
  loads serves a tile of query positions, where the decode kernel would read the context once per row.

SmolLM2's shapes, 2 threads (`python -m benchmarks.kernels_bench chunk-attention`, on an AMD EPYC with AVX-512):
the prefill kernel is 2.0-2.7x faster than torch's SDPA from 16 tokens up at every context, and faster than decode
rows from 8-16 tokens up; decode rows win at 4 (3.2 vs 2.5x). The plan is built by the first layer of a step and
reused by the others: the index tensors cost more host time to build than one layer's attention of a short step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_CHUNK_AS_DECODE_ROWS = 8


@dataclass(frozen=True)
class CpuStepPlan:
    # Decode kernel: per-row block tables and context lengths, and which query rows they are (None: all, in order).
    decode_tables: torch.Tensor | None
    decode_lens: torch.Tensor | None
    decode_index: torch.Tensor | None
    # Prefill kernel, int32: block tables, seq lens, first query row and query length of each long chunk.
    prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None


def decode_rows(block_tables: torch.Tensor, query_lens: list[int],
                seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row as its own decode: (block table per row, context length per row)."""
    index: list[int] = []
    lens: list[int] = []
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        index += [i] * q_len
        lens += range(seq_len - q_len + 1, seq_len + 1)
    rows = torch.tensor(index, dtype=torch.long, device=block_tables.device)
    return (block_tables.index_select(0, rows),
            torch.tensor(lens, dtype=torch.int32, device=block_tables.device))


def plan_step(block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
              max_rows_chunk: int = MAX_CHUNK_AS_DECODE_ROWS) -> CpuStepPlan:
    """Chunks of up to max_rows_chunk tokens (and decodes, always) go to the decode kernel, longer ones to the
    prefill kernel."""
    max_rows_chunk = max(1, max_rows_chunk)
    device = block_tables.device
    # A long chunk counts as 0 rows for the decode kernel: decode_rows then yields only the short chunks' rows.
    row_lens = [q_len if q_len <= max_rows_chunk else 0 for q_len in query_lens]
    long = [i for i, q_len in enumerate(query_lens) if q_len > max_rows_chunk]
    decode_tables = decode_lens = decode_index = prefill = None
    if any(row_lens):
        decode_tables, decode_lens = decode_rows(block_tables, row_lens, seq_lens)
    starts = [0] * len(query_lens)
    for i in range(1, len(query_lens)):
        starts[i] = starts[i - 1] + query_lens[i - 1]
    if any(row_lens) and long:
        rows = [r for start, n in zip(starts, row_lens, strict=True) for r in range(start, start + n)]
        decode_index = torch.tensor(rows, dtype=torch.long, device=device)
    if long:
        prefill = (block_tables[long].to(torch.int32).contiguous(),
                   torch.tensor([seq_lens[i] for i in long], dtype=torch.int32, device=device),
                   torch.tensor([starts[i] for i in long], dtype=torch.int32, device=device),
                   torch.tensor([query_lens[i] for i in long], dtype=torch.int32, device=device))
    return CpuStepPlan(decode_tables, decode_lens, decode_index, prefill)


def run_plan(cpu_ext, query: torch.Tensor, key_cache: torch.Tensor,  # noqa: ANN001 - the extension module
             value_cache: torch.Tensor, plan: CpuStepPlan, scale: float, **options) -> torch.Tensor:
    """Attention of one step's packed query rows [T, H, D] by the plan; returns [T, H, D]. options:
    sliding_window and logits_soft_cap; each decode row is windowed by its own context length, so a short chunk
    split into rows keeps the window of every position."""
    query = query.contiguous()
    out = torch.empty_like(query)
    if plan.decode_tables is not None:
        if plan.decode_index is None:
            cpu_ext.paged_decode(query, key_cache, value_cache, plan.decode_tables, plan.decode_lens, scale, out=out,
                                 **options)
        else:
            rows = cpu_ext.paged_decode(query.index_select(0, plan.decode_index), key_cache, value_cache,
                                        plan.decode_tables, plan.decode_lens, scale, **options)
            out.index_copy_(0, plan.decode_index, rows)
    if plan.prefill is not None:
        cpu_ext.paged_prefill(query, key_cache, value_cache, *plan.prefill, scale, out=out, **options)
    return out
