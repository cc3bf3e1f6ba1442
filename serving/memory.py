"""How many KV blocks fit the configured memory budget."""
from __future__ import annotations

import torch

from conveyor.serving.config import CacheConfig


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V for one block across all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def num_kv_blocks(cache: CacheConfig, bytes_per_block: int, device: torch.device) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    budget = cache.kv_cache_bytes
    if budget is None:
        budget = int(available_memory_bytes(device) * cache.memory_fraction)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {bytes_per_block} bytes; "
                         "raise kv_cache_bytes or memory_fraction")
    return num_blocks


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory_in_process(threshold_bytes: int = 256 << 20) -> bool:
    """Stop glibc from returning large freed buffers to the OS.

    Each engine step allocates the same multi-MB temporaries (activations, gathered K/V). By default glibc
    serves those with fresh mmaps and unmaps them on free, so every step page-faults them back in: on the
    2-core CI VM that made a KV gather run at ~1.5 GB/s instead of ~9. Raising the mmap and trim thresholds
    keeps them on the heap for reuse. A no-op (returns False) where libc has no mallopt.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, 4 * threshold_bytes))
