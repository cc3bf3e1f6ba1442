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


def linear_flops(shapes: list[tuple[int, int]], num_rows: int = 512, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of the best GEMM this machine has for a model's linears (out, in) at num_rows tokens: oneDNN with
    packed weights (what the engine runs) or torch's default (MKL), whichever is faster here. A square torch.mm
    alone understates it where MKL takes a slow path: on AMD Zen 5, 148 against oneDNN's ~470 GFLOP/s fp32."""
    import torch.nn.functional as F

    from conveyor.serving.models.cpu_packing import PackedLinear, packable_dtypes

    weights = [torch.randn(n, k, dtype=dtype) for n, k in shapes]
    inputs = [torch.randn(num_rows, k, dtype=dtype) for _, k in shapes]
    flops = sum(2 * num_rows * n * k for n, k in shapes)
    best = flops / _best_of(lambda: [F.linear(x, w) for x, w in zip(inputs, weights, strict=True)])
    if dtype in packable_dtypes():
        packed = [PackedLinear(w, None) for w in weights]
        best = max(best, flops / _best_of(lambda: [lin(x) for x, lin in zip(inputs, packed, strict=True)]))
    return best


def model_linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's fused projections (qkv, o, gate_up, down) of an HF Llama config."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_dim = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    return [(heads * head_dim + 2 * kv_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden), (hidden, inter)]


def copy_bandwidth(num_bytes: int = 256 << 20) -> float:
    """Bytes moved per second (read + write) by a large tensor copy."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _best_of(lambda: dst.copy_(src))


def decode_step_floor(num_params: int, bytes_per_param: int, batch_size: int, flops: float,
                      bandwidth: float) -> float:
    """Seconds for one decode step if it only had to read the weights once and do 2 FLOP per param per token."""
    return max(num_params * bytes_per_param / bandwidth, 2 * num_params * batch_size / flops)
