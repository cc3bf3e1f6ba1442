"""JIT build and Python wrappers of the CUDA kernels in csrc/ (decode attention, KV-cache write).

Built with torch.utils.cpp_extension.load into a cached build dir, only where torch has CUDA and a CUDA
toolchain exists. CPU torch forces CUDA_HOME to None, so there the build is refused with a clear RuntimeError.
"""
from __future__ import annotations

import functools
import os
import pathlib
import shutil
from types import ModuleType

import torch

CSRC = pathlib.Path(__file__).parent / "csrc"
SOURCES = [CSRC / "binding.cpp", CSRC / "paged_attention.cu"]
# Context positions per split-K partition: a multiple of every block size, long enough to amortize a block's
# setup and merge, short enough that a few long sequences still fill the GPU.
PARTITION_SIZE = 512


def build_dir() -> pathlib.Path:
    """CONVEYOR_CUDA_BUILD_DIR, else ~/.cache/conveyor/cuda_ext: rebuilt only when sources change."""
    default = pathlib.Path.home() / ".cache" / "conveyor" / "cuda_ext"
    return pathlib.Path(os.environ.get("CONVEYOR_CUDA_BUILD_DIR", default))


def unavailable_reason() -> str | None:
    """Why the extension cannot be built here, or None when it can."""
    if torch.version.cuda is None:
        return "torch has no CUDA (CPU build)"
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        return "no CUDA toolchain (CUDA_HOME unset and nvcc not on PATH)"
    return None


@functools.cache
def load() -> ModuleType:
    """Build (first call, cached on disk) and import the extension; RuntimeError where that is impossible."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"conveyor CUDA kernels unavailable: {reason}")
    from torch.utils import cpp_extension

    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    from conveyor.kernels.cpu_ext import build_lock

    with build_lock(directory):  # a build killed midway must not hang every later start (cpu_ext.build_lock)
        return cpp_extension.load(
            name="conveyor_cuda_kernels",
            sources=[str(s) for s in SOURCES],
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo"],
            build_directory=str(directory),
            verbose=os.environ.get("CONVEYOR_CUDA_VERBOSE") == "1",
        )


def is_available() -> bool:
    return unavailable_reason() is None


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the decode kernel has a variant for this dtype and head_dim (16-byte rows, <= 32 lanes)."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16) or head_dim not in (32, 64, 128, 256):
        return False
    return head_dim * dtype.itemsize // 16 <= 32


def num_partitions_for(max_seq_len: int, num_seqs: int, num_kv_heads: int,
                       partition_size: int = PARTITION_SIZE) -> int:
    """Split-K only when one block per (sequence, kv head) would leave SMs idle and the context is long."""
    parts = max(1, -(-max_seq_len // partition_size))
    if parts == 1:
        return 1
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return parts if num_seqs * num_kv_heads < 4 * sms else 1


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                 out: torch.Tensor | None = None, num_partitions: int | None = None,
                 partition_size: int = PARTITION_SIZE, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> torch.Tensor:
    """Decode attention, one query token per sequence: query [S, H, D] -> [S, H, D].

    num_partitions: None picks split-K by the heuristic; 1 forces one pass; it must cover max_seq_len (or the
    window, which is where partitions start counting). Options as reference.paged_attention's.
    """
    if out is None:
        out = torch.empty_like(query)
    if sliding_window is not None:
        max_seq_len = min(max_seq_len, sliding_window)
    if num_partitions is None:
        num_partitions = num_partitions_for(max_seq_len, query.shape[0], key_cache.shape[2], partition_size)
    if num_partitions == 1:
        partition_size = 1 << 30  # one partition covers any context: no trust in max_seq_len needed
    elif num_partitions * partition_size < max_seq_len:
        raise ValueError(f"{num_partitions} partitions of {partition_size} do not cover {max_seq_len}")
    load().paged_decode(out, query, key_cache, value_cache, block_tables, seq_lens, scale, partition_size,
                        num_partitions, sliding_window or 0, float(logits_soft_cap or 0.0))
    return out


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    load().write_kv_cache(key, value, key_cache, value_cache, slot_mapping.long())
