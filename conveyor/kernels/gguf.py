"""Linear layers over weights kept in GGUF block formats (Q4_1, Q8_0), and their torch reference.

The CPU kernels expand the quants to float32 in registers and multiply with float32 activations, so they compute
what the dequantized weights compute, up to summation order, while reading 5 (Q4_1) or 8.5 (Q8_0) bits per weight
instead of 32. `prepare` (once, at load time) keeps GGUF's rows of blocks for the smallest steps
(csrc/cpu/gguf_rows_cpu.cpp) and a copy with groups of output features interleaved for the rest
(csrc/cpu/gguf_linear_cpu.cpp); `gguf_linear` picks by the step's rows. `prepare_int8` adds a layout for the
int8-activation kernel (csrc/cpu/gguf_int8_cpu.cpp, AVX2: gguf_int8_avx2_cpu.cpp; cpu_prefill_dtype int8), which
rounds each block of 32 activations to int8 as llama.cpp does instead of computing what the dequantized weights
compute.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.kernels import cpu_ext

BLOCK = 32
Q4_1 = 3  # ggml type ids, as GGUF files name them
Q8_0 = 8
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0"}


def default_max_rows() -> int:
    """The largest step (in tokens) that reads the GGUF quants rather than the packed fp32 weights, by SIMD level.
    The interleaved kernel beats oneDNN's packed fp32 on SmolLM2's linears up to ~64 rows with AVX-512 and with
    AVX2 (fp32 is ahead from 128 rows on AVX2, from 256 on AVX-512), so decode steps of up to 64 rows read the
    quants (figures: benchmarks/RESULTS.md, "Defaults and the measurements behind them"). Without AVX2 the
    portable kernel runs: 8."""
    return 64 if torch.backends.cpu.get_cpu_capability() in cpu_ext.VEC_CAPABILITIES else 8


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


@dataclass(frozen=True)
class GGUFWeight:
    """A [out_features, in_features] weight in the kernel's layout (gguf_linear_cpu.cpp): groups of `lanes`
    output features side by side. q uint8 [groups, quant rows, lanes]: per block of 32 inputs, Q4_1 keeps GGUF's 16
    nibble-pair bytes (inputs j and 16 + j), Q8_0 its 32 int8; scales float16 [groups, K / 32, 2, lanes], d and m
    per block (Q8_0: m = 0)."""

    q: torch.Tensor
    scales: torch.Tensor
    ggml_type: int
    out_features: int
    blocks: torch.Tensor  # GGUF's own rows of blocks, for the smallest steps (see gguf_linear)

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        """What a step that uses every feature reads (either layout: the same quants and scales)."""
        return self.blocks.numel()

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], from this layout (d * q + m; Q8_0: d * q): for checks against `dequantize`."""
        groups, _, lanes = self.q.shape
        num_blocks = self.scales.shape[1]
        if self.ggml_type == Q8_0:
            q = self.q.view(torch.int8).float().reshape(groups, num_blocks, BLOCK, lanes)
        else:
            packed = self.q.reshape(groups, num_blocks, BLOCK // 2, lanes)
            q = torch.cat([packed & 0x0F, packed >> 4], dim=2).float()
        scales = self.scales.float()
        d, m = scales[:, :, 0:1, :], scales[:, :, 1:2, :]
        w = q * d if self.ggml_type == Q8_0 else q * d + m
        return w.permute(0, 3, 1, 2).reshape(groups * lanes, self.in_features)[: self.out_features]


def prepare(weight: torch.Tensor, ggml_type: int, in_features: int) -> GGUFWeight:
    """GGUF rows of blocks uint8 [N, K / 32 * block bytes] -> the kernel's layout. Needs is_available()."""
    row_bytes(ggml_type, in_features)  # validates type and K with a ValueError
    q, scales = torch.ops.conveyor_cpu.gguf_prepare(weight, ggml_type, in_features)
    return GGUFWeight(q, scales, ggml_type, weight.shape[0], weight.contiguous())


# Steps of up to this many rows run over GGUF's own rows of blocks (gguf_rows_cpu.cpp), larger ones over the
# feature-interleaved layout (gguf_linear_cpu.cpp): the crossovers on SmolLM2's shapes, where the interleaved kernel
# is 1.4-1.5x faster at 8-32 rows (benchmarks/RESULTS.md, "Defaults and the measurements behind them").
ROWS_KERNEL_MAX_ROWS = {Q4_1: 3, Q8_0: 6}


# With bf16 products allowed (cpu_prefill_dtype bfloat16), steps of at least this many rows take the bf16 kernel
# (gguf_bf16_cpu.cpp), which reads the same quants: SmolLM2's 120 layer linears on a 2-core Zen 4, fp32 / bf16 kernel
# / oneDNN packed bf16, ms: 4 rows 7.6 / 9.1 / 14.0, 8 rows 11.5 / 11.2 / 15.2, 16 rows 21.5 / 16.3 / 19.3, 32 rows
# 39.3 / 24.3 / 28.2, 64 rows 77.5 / 41.1 / 45.0 (benchmarks/RESULTS.md, "Defaults and the measurements behind them").
BF16_MIN_ROWS = 8


def has_bf16_kernel() -> bool:
    """Whether the bf16-product kernel is built here: it needs AVX512-BF16."""
    return cpu_ext.has_op("gguf_linear_bf16")


def gguf_linear(x: torch.Tensor, weight: GGUFWeight, bf16_min_rows: int | None = None,
                int8_weight: Int8Weight | None = None) -> torch.Tensor:
    """x float32 [..., K] @ W^T -> float32 [..., out_features]; bias is the caller's. Steps past the rows kernel
    take the int8 kernel where int8_weight (prepare_int8 of weight) is given (has_int8_kernel() must hold), else
    from bf16_min_rows rows round weights and activations to bf16 (has_bf16_kernel() must hold; None: never).
    The ops must be registered: check is_available() first (it loads the extension)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= ROWS_KERNEL_MAX_ROWS[weight.ggml_type]:
        out = torch.ops.conveyor_cpu.gguf_linear_rows(flat, weight.blocks, weight.ggml_type, weight.out_features)
    elif int8_weight is not None:
        out = gguf_linear_int8(flat, int8_weight)
    elif bf16_min_rows is not None and flat.shape[0] >= bf16_min_rows:
        out = torch.ops.conveyor_cpu.gguf_linear_bf16(flat, weight.q, weight.scales, weight.ggml_type,
                                                      weight.out_features)
    else:
        out = torch.ops.conveyor_cpu.gguf_linear(flat, weight.q, weight.scales, weight.ggml_type, weight.out_features)
    return out.view(*x.shape[:-1], weight.out_features)


@dataclass(frozen=True)
class Int8Weight:
    """A GGUFWeight's quants laid out for the int8 kernel (gguf_int8_cpu.cpp): u uint8 [groups, K / 32, 8, 16, 4],
    per block eight quads of four consecutive inputs with each feature lane's four together, unsigned (Q8_0: q + 128);
    dm float32 [groups, K / 32, 2, 16], d and m of w = d * u + m (Q8_0: m = -128 d). On AVX2 the lanes are 8, as
    gguf_prepare's, and the kernel picks its int16 or int32 sums by ggml_type."""

    u: torch.Tensor
    dm: torch.Tensor
    ggml_type: int
    out_features: int


def prepare_int8(weight: GGUFWeight) -> Int8Weight:
    """The int8 kernel's layout of a prepared weight (1 byte per weight: the nibbles unpacked once here)."""
    groups, _, lanes = weight.q.shape
    num_blocks = weight.scales.shape[1]
    if weight.ggml_type == Q8_0:
        u = (weight.q.view(torch.int8).to(torch.int16) + 128).to(torch.uint8).reshape(groups, num_blocks, BLOCK, lanes)
    else:
        packed = weight.q.reshape(groups, num_blocks, BLOCK // 2, lanes)
        u = torch.cat([packed & 0x0F, packed >> 4], dim=2)
    u = u.reshape(groups, num_blocks, BLOCK // 4, 4, lanes).permute(0, 1, 2, 4, 3).contiguous()
    scales = weight.scales.float()
    d = scales[:, :, 0]
    m = -128.0 * d if weight.ggml_type == Q8_0 else scales[:, :, 1]
    return Int8Weight(u, torch.stack([d, m], dim=2).contiguous(), weight.ggml_type, weight.out_features)


def round_activations_int8(x: torch.Tensor) -> torch.Tensor:
    """What the int8 kernel multiplies instead of x float32 [..., K]: each block of 32 rounded to int8 (nearest even)
    at the scale max|x| / 127, dequantized back (llama.cpp's Q8 activations)."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # torch.div, not 127.0 / amax: torch computes a scalar over a tensor as a reciprocal times the scalar, an ulp
    # off the kernel's division, which flips the rounding of an activation at a tie
    inverse = torch.where(amax > 0, torch.div(torch.full_like(amax, 127.0), amax), torch.zeros_like(amax))
    quants = torch.round(blocks * inverse).clamp(-128, 127)
    return (quants * (amax / 127.0)).reshape(x.shape)


def int8_linear_reference(x: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
    """The int8 kernel's result in torch, in float64: the int8-rounded activations times the dequantized weight."""
    return (round_activations_int8(x).double() @ dequantized.double().T).float()


def has_int8_kernel() -> bool:
    """Whether the int8-activation kernel is built here: it needs AVX512-VNNI or AVX2."""
    return cpu_ext.has_op("gguf_linear_int8")


def gguf_linear_int8(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x float32 [..., K] @ W^T with int8-rounded activations (round_activations_int8); bias is the caller's."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.conveyor_cpu.gguf_linear_int8(flat, weight.u, weight.dm, weight.ggml_type,
                                                 weight.out_features)
    return out.view(*x.shape[:-1], weight.out_features)
