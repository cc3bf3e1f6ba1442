"""Decode attention on CPU: the "torch" backend (gathers K/V with index_select) against "cpu" (the C++ kernel).

SmolLM2 shapes (9 query heads : 3 KV heads, head_dim 64, block 16, float32), batch x context grid, one layer's
attention of a pure decode step through ops.paged_attention, the way the engine calls it (zero-filled cache,
finite_cache=True, host length lists). Prints median milliseconds per call and the speedup.

    .venv/bin/python benchmarks/cpu_attention_bench.py [--threads 2] [--batches 1 4 16 32] [--contexts ...]
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # for tests.kernels.cases

from conveyor.kernels import ops  # noqa: E402
from tests.kernels.cases import make_case, rel_err  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def median_ms(fn: Callable[[], object], budget_s: float, min_reps: int = 5, max_reps: int = 2000) -> float:
    """Median wall time of fn over as many runs as fit in budget_s (after two warm-up calls)."""
    fn()
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def bench_point(batch: int, context: int, budget_s: float) -> tuple[float, float, float]:
    """(torch ms, cpu ms, relative difference of their outputs) for one batch x context."""
    case = make_case([(1, context)] * batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK, poison_tail=False, seed=batch)

    def run(backend: str) -> torch.Tensor:
        return ops.paged_attention(*case.args(), **case.kwargs(), backend=backend, finite_cache=True)

    diff = rel_err(run("cpu"), run("torch"))
    return median_ms(lambda: run("torch"), budget_s), median_ms(lambda: run("cpu"), budget_s), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[300, 1000, 2000])
    parser.add_argument("--budget-s", type=float, default=0.5, help="timing budget per backend and point")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if "cpu" not in ops.available_backends("cpu"):
        sys.exit("the cpu backend is unavailable here (the C++ extension does not build)")
    print(f"H={HEADS} KVH={KV_HEADS} D={HEAD_DIM} block={BLOCK} float32, {args.threads} threads, median ms/call")
    print(f"{'batch':>5} {'context':>7} {'torch':>9} {'cpu':>9} {'speedup':>8} {'rel diff':>9}")
    for batch in args.batches:
        for context in args.contexts:
            torch_ms, cpu_ms, diff = bench_point(batch, context, args.budget_s)
            print(f"{batch:>5} {context:>7} {torch_ms:>9.3f} {cpu_ms:>9.3f} {torch_ms / cpu_ms:>7.1f}x {diff:>9.1e}")


if __name__ == "__main__":
    main()
