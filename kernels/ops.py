"""One dispatch point for attention kernels. Imports nothing of Conveyor's."""
from __future__ import annotations

import torch

from conveyor.kernels import reference, torch_native

BACKENDS = ("torch", "triton", "cuda", "flash")


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "torch") -> None:
    if backend == "reference":
        return reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    return torch_native.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, *, max_query_len: int, max_seq_len: int,
                    seq_lens_list: list[int] | None = None, query_lens_list: list[int] | None = None,
                    backend: str = "torch") -> torch.Tensor:
    if backend == "reference":
        return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, scale)
    return torch_native.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                        scale, seq_lens_list=seq_lens_list, query_lens_list=query_lens_list)


def resolve_backend(name: str, device: torch.device) -> str:
    """'auto' -> the best backend for the device; other names are checked."""
    if name == "auto":
        return "torch"
    if name not in BACKENDS and name != "reference":
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    return name
