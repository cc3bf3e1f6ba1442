"""Apply a grammar's token bitmask to logits rows: the CPU kernel (csrc/cpu/token_bitmask_cpu.cpp) and its torch
reference, which also serves other devices and machines where the extension cannot be built.

bitmask: int32 [R, W], bit j of word w allowing token 32 w + j (llguidance's and xgrammar's layout). Every
logit of rows[i] whose token is not allowed becomes -inf, in place; logits past 32 W (a padded vocabulary) too.
"""
from __future__ import annotations

import torch

from conveyor.kernels import cpu_ext

BITS = 32


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool (allowed); past 32 W False."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1).bool()
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - bits.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([bits, pad], dim=1)


def apply_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    allowed = unpack(bitmask.to(logits.device), logits.shape[-1])
    index = rows.to(logits.device)
    logits[index] = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))


def kernel_available() -> bool:
    return cpu_ext.has_op("apply_token_bitmask")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place; the kernel for float32 CPU logits when it is built, else the reference."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and kernel_available():
        torch.ops.conveyor_cpu.apply_token_bitmask(logits, bitmask.contiguous(), rows.to(torch.int64).contiguous())
    else:
        apply_reference(logits, bitmask, rows)
