"""What this CPU can do at best: measured matmul FLOP/s and memory copy bandwidth."""
from __future__ import annotations

import time

import torch


def _best_of(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_flops(n: int = 1024, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best_of(lambda: torch.mm(a, b))


def copy_bandwidth(num_bytes: int = 256 << 20) -> float:
    """Bytes moved per second (read + write) by a large tensor copy."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _best_of(lambda: dst.copy_(src))


def decode_step_floor(num_params: int, bytes_per_param: int, batch_size: int, flops: float,
                      bandwidth: float) -> float:
    """Seconds for one decode step if it only had to read the weights once and do 2 FLOP per param per token."""
    return max(num_params * bytes_per_param / bandwidth, 2 * num_params * batch_size / flops)
