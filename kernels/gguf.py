"""Linear layers over weights kept in GGUF block formats (Q4_1, Q8_0), and their torch reference.

The CPU kernel (csrc/cpu/gguf_linear_cpu.cpp, torch.ops.conveyor_cpu.gguf_linear) expands each block to float32
in registers and multiplies with float32 activations, so it computes what the dequantized weights compute, up to
summation order, while reading 5 (Q4_1) or 8.5 (Q8_0) bits per weight instead of 32.
"""
from __future__ import annotations

import torch

from conveyor.kernels import cpu_ext

BLOCK = 32
Q4_1 = 3  # ggml type ids, as GGUF files name them
Q8_0 = 8
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0"}


def default_max_rows() -> int:
    """The largest step (in tokens) for which the kernel beats the packed fp32 GEMM, by the kernel's SIMD level:
    AVX-512 expands each block once for 8 rows, AVX2 for 4. SmolLM2, decode step by batch size (AMD EPYC Zen 5,
    2 threads): 16 rows 27 against 30 ms, 24 rows 38 against 38 (benchmarks/RESULTS.md, "Session 10"); on the
    AVX2-only CPU of earlier sessions the crossover was at 8."""
    return 16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8


def is_available() -> bool:
    """Whether the CPU extension with the kernel builds and loads here."""
    return cpu_ext.has_op("gguf_linear")


def row_bytes(ggml_type: int, in_features: int) -> int:
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"unsupported ggml type {ggml_type}; supported: {sorted(TYPE_NAMES.values())}")
    if in_features % BLOCK:
        raise ValueError(f"in_features must be a multiple of {BLOCK}, got {in_features}")
    return in_features // BLOCK * BLOCK_BYTES[ggml_type]


def dequantize(weight: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    """uint8 [N, K / 32 * block bytes] -> float32 [N, K], the way ggml dequantizes (d * q + m, d * q)."""
    num_rows = weight.shape[0]
    if weight.shape[1] != row_bytes(ggml_type, in_features):
        raise ValueError(f"weight rows hold {weight.shape[1]} bytes, expected {row_bytes(ggml_type, in_features)}")
    blocks = weight.reshape(num_rows, in_features // BLOCK, BLOCK_BYTES[ggml_type])
    scale = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if ggml_type == Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * scale).reshape(num_rows, in_features)
    low_bound = blocks[..., 2:4].contiguous().view(torch.float16).float()
    packed = blocks[..., 4:]
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
    return (q * scale + low_bound).reshape(num_rows, in_features)


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, out_features: int) -> torch.Tensor:
    """x float32 [..., K] @ dequantize(weight)^T -> float32 [..., out_features]; bias is the caller's.
    The op must be registered: check is_available() first (it loads the extension)."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.conveyor_cpu.gguf_linear(flat, weight, ggml_type, out_features)
    return out.view(*x.shape[:-1], out_features)


def quantize(weight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """float [N, K] -> uint8 blocks [N, K / 32 * block bytes], ggml's round-to-nearest scheme (for tests and
    benchmarks; models get their blocks from a GGUF file)."""
    num_rows, in_features = weight.shape
    row_bytes(ggml_type, in_features)  # validates type and K
    w = weight.float().reshape(num_rows, in_features // BLOCK, BLOCK)
    if ggml_type == Q8_0:
        scale = (w.abs().amax(-1, keepdim=True) / 127).half()
        inv = torch.where(scale.float() > 0, 1 / scale.float(), torch.zeros(()))
        q = (w * inv).round().clamp(-127, 127).to(torch.int8)
        parts = [scale.view(torch.uint8), q.view(torch.uint8)]
    else:
        low = w.amin(-1, keepdim=True)
        scale = ((w.amax(-1, keepdim=True) - low) / 15).half()
        inv = torch.where(scale.float() > 0, 1 / scale.float(), torch.zeros(()))
        q = ((w - low.half().float()) * inv).round().clamp(0, 15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        parts = [scale.view(torch.uint8), low.half().view(torch.uint8), packed]
    return torch.cat(parts, dim=-1).reshape(num_rows, -1).contiguous()
