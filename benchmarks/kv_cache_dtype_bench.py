"""Decode attention from DRAM with a float32, a bfloat16 and fp8 KV caches (float32 queries), the CPU kernel.

One decode step's attention over every layer of SmolLM2-135M (30 layers, 9 query heads : 3 KV heads, head_dim
64, block 16 or --block-size), each layer with its own cache so nothing stays in the L3 as it would if one
layer were timed in a loop; blocks in a random order, as a long-running engine's are. Prints the median
milliseconds per step, the K/V bytes read and the rate, for each cache dtype, interleaved in one run.

    .venv/bin/python benchmarks/kv_cache_dtype_bench.py [--batches 1 16 64] [--context 300] [--threads 2]
        [--block-size 16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from conveyor.kernels import cpu_ext
from conveyor.kernels.reference import to_cache_dtype

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def bench(batch: int, context: int, reps: int, block: int = 16) -> dict[str, float]:
    blocks_per_seq = -(-context // block)
    num_blocks = batch * blocks_per_seq + 8
    tables = torch.randperm(num_blocks)[: batch * blocks_per_seq].reshape(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    shape = (num_blocks, block, KV_HEADS, HEAD_DIM)
    fp32 = [(torch.randn(shape), torch.randn(shape)) for _ in range(LAYERS)]
    caches = {"float32": fp32, "bfloat16": [(k.bfloat16(), v.bfloat16()) for k, v in fp32]}
    for name in ("float8_e4m3fn", "float8_e5m2"):
        dtype = getattr(torch, name)
        caches[name] = [(to_cache_dtype(k, dtype), to_cache_dtype(v, dtype)) for k, v in fp32]
    query = torch.randn(batch, HEADS, HEAD_DIM)
    out = torch.empty_like(query)

    def step(name: str) -> None:
        for k, v in caches[name]:
            cpu_ext.paged_decode(query, k, v, tables, lens, HEAD_DIM ** -0.5, out=out)

    times: dict[str, list[float]] = {name: [] for name in caches}
    for name in caches:
        step(name)
    for _ in range(reps):
        for name in caches:
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per cache block (the engine's default: 16)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_ext.load()
    for batch in args.batches:
        result = bench(batch, args.context, args.reps, args.block_size)
        cells = []
        for name, seconds in result.items():
            nbytes = LAYERS * 2 * batch * args.context * KV_HEADS * HEAD_DIM * torch.empty((), dtype=getattr(
                torch, name)).element_size()
            cells.append(f"{name} {seconds * 1e3:7.2f} ms ({nbytes / 1e6:5.0f} MB, {nbytes / seconds / 1e9:5.1f} GB/s)")
        speedups = "  ".join(f"{name} {result['float32'] / result[name]:.2f}x" for name in result if name != "float32")
        head = f"batch {batch:3d} x context {args.context}, block {args.block_size}: "
        print(head + "\n  ".join(cells) + f"\n  speed-up over float32: {speedups}")


if __name__ == "__main__":
    main()
