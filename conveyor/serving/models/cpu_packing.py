"""oneDNN weight pre-packing for CPU inference.

MKL's GEMM repacks a cold weight matrix on every call; at decode batch sizes (M = 1..64 rows) that repacking,
not the arithmetic, dominates. Re-laying each weight out once for oneDNN halves the step time of SmolLM2 on
the 2-core CI VM (measured: 120 linears at M=16, 51 ms -> 27 ms; prefill at M=512, 164 -> 193 GFLOP/s).
Results differ from nn.Linear only by float32 summation order.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

# oneDNN picks the packed layout for a typical batch size; any M works at run time.
_BATCH_SIZE_HINT = 16


def cpu_weight_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """float32 always; bfloat16 where the CPU multiplies it natively (AVX512-BF16, AMX). There oneDNN's packed
    bfloat16 runs SmolLM2's linears at ~2x its packed float32 rate and 1.3x an unpacked bfloat16 linear (Zen 5:
    841 / 447 / 627 GFLOP/s at M=64). Elsewhere bfloat16 is emulated and far slower than float32 anyway."""
    if not cpu_weight_packing_available():
        return ()
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


def pack_weight(weight: Tensor) -> Tensor:
    """A [out, in] weight re-laid out for packed_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_SIZE_HINT)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, in] (contiguous) @ the packed weight's [out, in].T (+ bias) -> [M, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = pack_weight(weight)
        self.bias = None if bias is None else bias.detach().contiguous()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = packed_linear(flat, self.packed_weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


class Bfloat16PackedLinear(PackedLinear):
    """float32 in and out, multiplied in bfloat16: the weight packed for oneDNN in bf16, each input rounded to bf16
    on the way in, the bf16 product widened back to float32 (a bias added in float32). Where the CPU multiplies
    bf16 natively this runs SmolLM2's prefill-sized linears at ~1.8x the packed float32 rate (Zen 4, 64-512
    rows: 373-391 against 205-214 GFLOP/s); the price is bf16 rounding of the activations and weights of those
    matmuls only."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__(weight.detach().to(torch.bfloat16), None)
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = packed_linear(flat, self.packed_weight).float()
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


def pack_linears(module: nn.Module, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> int:
    """Replace every nn.Linear under module whose weight is of one of `dtypes` with a PackedLinear, in place;
    returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.weight.dtype in dtypes:
            setattr(module, name, PackedLinear.from_linear(child))
            count += 1
        else:
            count += pack_linears(child, dtypes)
    return count
