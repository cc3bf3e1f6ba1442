"""A prefill chunk's attention on CPU: the decode kernel row by row (cpu_plan.decode_rows, what backend "cpu" does for
chunks up to cpu_plan.MAX_CHUNK_AS_DECODE_ROWS tokens), our prefill kernel (csrc/cpu/prefill_attention_cpu.cpp, what
it does for longer chunks) and gathering the context for torch's SDPA (the torch backend).

SmolLM2 shapes (9 query heads : 3 KV heads, head_dim 64, block 16, float32), one layer, one chunk of q tokens
ending at a context of c tokens. Prints median milliseconds per call, the speedups over SDPA and the largest
difference from it.

    .venv/bin/python benchmarks/chunk_attention_bench.py [--threads 2] [--chunks 4 16 64 512] [--contexts ...]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from conveyor.kernels import cpu_plan, ops, torch_native

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def median_ms(fn: Callable[[], object], reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128, 512])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    num_blocks = max(args.contexts) // BLOCK + 8
    key_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    value_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    scale = HEAD_DIM ** -0.5
    print(f"{'context':>8} {'chunk':>6} {'sdpa+gather ms':>15} {'decode rows ms':>15} {'prefill ms':>11} "
          f"{'rows x':>7} {'prefill x':>9} {'max diff':>9}")
    for context in args.contexts:
        table = torch.randperm(num_blocks)[: -(-context // BLOCK)].to(torch.int32).unsqueeze(0)
        for chunk in (c for c in args.chunks if c <= context):
            query = torch.randn(chunk, HEADS, HEAD_DIM)
            rows = cpu_plan.decode_rows(table, [chunk], [context])

            sdpa = functools.partial(torch_native._prefill_one, query, key_cache, value_cache,  # noqa: SLF001
                                     table[0], context, scale)
            decode_rows = functools.partial(ops._cpu_ext().paged_decode, query, key_cache, value_cache,  # noqa: SLF001
                                            rows[0], rows[1], scale)

            lens = torch.tensor([context], dtype=torch.int32)
            prefill = functools.partial(ops._cpu_ext().paged_prefill, query, key_cache, value_cache,  # noqa: SLF001
                                        table, lens, torch.zeros(1, dtype=torch.int32),
                                        torch.tensor([chunk], dtype=torch.int32), scale)

            expected = sdpa()
            diff = max((expected - f()).abs().max().item() for f in (decode_rows, prefill))
            base, rows_ms, prefill_ms = median_ms(sdpa), median_ms(decode_rows), median_ms(prefill)
            print(f"{context:>8} {chunk:>6} {base:>15.3f} {rows_ms:>15.3f} {prefill_ms:>11.3f} "
                  f"{base / rows_ms:>6.1f}x {base / prefill_ms:>8.1f}x {diff:>9.1e}")


if __name__ == "__main__":
    main()
