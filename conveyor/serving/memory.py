"""The KV cache's dtype, and how many of its blocks fit the configured memory budget."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from conveyor.kernels import ops
from conveyor.serving.config import CacheConfig

logger = logging.getLogger(__name__)


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


def cuda_kv_cache_bytes(utilization: float, total: int, free: int, torch_reserved: int, torch_peak: int) -> int:
    """vLLM's rule: the engine may use utilization * total device memory. Off that come torch's peak allocation
    (weights + a max-size step's activations, profiled) and memory outside torch's caching allocator (CUDA
    context, cuBLAS workspaces, other processes: total - free - reserved). The rest is the KV cache's."""
    non_torch = max(0, total - free - torch_reserved)
    return int(total * utilization) - torch_peak - non_torch


def profile_cuda_kv_cache_bytes(utilization: float, device: torch.device,
                                profile_step: Callable[[], None] | None) -> int:
    """Run profile_step (a max-size step without the real KV cache) and apply cuda_kv_cache_bytes."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    if profile_step is not None:
        profile_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()  # the step's activations go back, so `free` counts them as ours to reuse
    free, total = torch.cuda.mem_get_info(device)
    budget = cuda_kv_cache_bytes(utilization, total, free, torch.cuda.memory_reserved(device), peak)
    logger.info("KV cache budget %.2f GiB: %.0f%% of %.1f GiB, minus torch peak %.2f GiB (weights + activations) "
                "and %.2f GiB outside torch", budget / 2**30, 100 * utilization, total / 2**30, peak / 2**30,
                max(0, total - free - torch.cuda.memory_reserved(device)) / 2**30)
    return budget


def num_kv_blocks(cache: CacheConfig, bytes_per_block: int, device: torch.device,
                  profile_step: Callable[[], None] | None = None) -> int:
    """Blocks for the first sizing rule that applies (see CacheConfig). profile_step: CUDA only, a max-size
    step whose peak activation memory the KV cache must leave room for."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    budget = cache.kv_cache_bytes
    knob = "kv_cache_bytes"
    if budget is None and device.type == "cuda":
        budget = profile_cuda_kv_cache_bytes(cache.gpu_memory_utilization, device, profile_step)
        knob = "gpu_memory_utilization"
    elif budget is None:
        budget = int(available_memory_bytes(device) * cache.memory_fraction)
        knob = "memory_fraction"
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {bytes_per_block} bytes; "
                         f"raise {knob} (or set kv_cache_bytes / num_blocks)")
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


# Attention backends whose kernels need the KV cache in the query's dtype (the others convert on write and read).
SAME_DTYPE_KV_BACKENDS = ("cuda", "flash")
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, attention_backend: str) -> torch.dtype:
    """CacheConfig.kv_cache_dtype -> the cache's torch dtype ("auto": the model's); ValueError where the resolved
    attention backend cannot hold the cache in a dtype other than the model's."""
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        if attention_backend not in ops.FP8_CACHE_BACKENDS:
            readers = " or ".join(ops.FP8_CACHE_BACKENDS)
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype} needs the {readers} attention backend, not "
                             f"{attention_backend!r} (set attention_backend, or another kv_cache_dtype)")
        return FP8_KV_CACHE_DTYPES[kv_cache_dtype]
    kv_dtype = model_dtype if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype)
    if kv_dtype != model_dtype and attention_backend in SAME_DTYPE_KV_BACKENDS:
        raise ValueError(f"kv_cache_dtype {_dtype_name(kv_dtype)} with a {_dtype_name(model_dtype)} model needs "
                         f"the cpu, torch or triton attention backend, not {attention_backend!r} "
                         "(set attention_backend, or kv_cache_dtype auto)")
    return kv_dtype
