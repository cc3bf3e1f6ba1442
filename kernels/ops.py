"""One dispatch point for attention kernels. Imports nothing of Conveyor's outside conveyor.kernels.

Backends:
- "reference": reference.py, the truth (slow, one sequence at a time).
- "torch": torch_native.py, vectorized torch; the CPU fallback when the C++ kernel cannot be built.
- "cpu": our C++ kernels (csrc/cpu/, JIT-built by cpu_ext.py): the decode kernel for every row of a step whose
  prefill chunks are at most MAX_CHUNK_AS_DECODE_ROWS tokens (row j of a chunk is a decode over its causal
  prefix; see decode_rows), torch_native's SDPA path for longer chunks, and the KV-cache write. The CPU default
  when it builds; torch where it does not.
- "triton": triton_attention.py, one varlen kernel for mixed steps (on CPU only under TRITON_INTERPRET=1).
- "cuda": our CUDA decode kernel (csrc/) for decode-only steps; steps with prefill chunks, or shapes the CUDA
  kernel lacks, go to triton (torch where triton is missing).
- "flash": FlashAttention's paged varlen kernel (flash.py) where it supports the dtype and block size, else
  triton.
Heavy modules (triton, the CUDA and CPU extensions, flash) are imported on first use only.
"""
from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType

import torch

from conveyor.kernels import reference, torch_native

BACKENDS = ("reference", "torch", "cpu", "triton", "cuda", "flash")
# Up to this chunk length the decode kernel over each row is used instead of gathering the context for SDPA.
# SmolLM2's shapes, 2 threads (benchmarks/chunk_attention_bench.py): 1.5-2.6x faster for 16-token chunks at 1-2k
# of context, 0.9-1.7x for 32-64, ~1.0x from 128 up: past 64 SDPA keeps the longer chunks.
MAX_CHUNK_AS_DECODE_ROWS = 64


@functools.cache
def _triton() -> ModuleType | None:
    try:
        return importlib.import_module("conveyor.kernels.triton_attention")
    except ImportError:
        return None


def _cuda_ext() -> ModuleType:
    return importlib.import_module("conveyor.kernels.cuda_ext")


def _cpu_ext() -> ModuleType:
    return importlib.import_module("conveyor.kernels.cpu_ext")


def _flash() -> ModuleType:
    return importlib.import_module("conveyor.kernels.flash")


def _triton_usable(device: torch.device) -> bool:
    if _triton() is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on this device in this process."""
    device = torch.device(device)
    names = ["reference", "torch"]
    if device.type == "cpu" and _cpu_ext().is_available():  # builds the extension on first ask (cached on disk)
        names.append("cpu")
    if _triton_usable(device):
        names.append("triton")
    if device.type == "cuda":
        if _cuda_ext().is_available():
            names.append("cuda")
        if _flash().is_available():
            names.append("flash")
    return names


def resolve_backend(name: str, device: torch.device | str) -> str:
    """Map "auto" to the best backend for the device; ValueError for an unknown or unavailable name.

    auto: CUDA device -> flash if importable, else cuda (decode; triton for prefill) if the extension can be
    built, else triton, else torch; CPU -> cpu if the C++ kernel builds, else torch.
    """
    device = torch.device(device)
    if name in ("reference", "torch"):  # always available: no need to build anything to say so
        return name
    available = available_backends(device)
    if name == "auto":
        if device.type != "cuda":
            return "cpu" if "cpu" in available else "torch"
        for candidate in ("flash", "cuda", "triton"):
            if candidate in available:
                return candidate
        return "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {('auto',) + BACKENDS}")
    if name not in available:
        raise ValueError(f"attention backend {name!r} is unavailable on {device}; available: {available}")
    return name


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _fallback_backend(device: torch.device) -> str:
    """Where cuda/flash send the steps they cannot run."""
    return "triton" if _triton_usable(device) else "torch"


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "torch") -> None:
    """cache[slot // block_size, slot % block_size] = key/value rows; slot < 0 skips the token."""
    if backend == "reference":
        return reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    if backend == "cuda":
        try:
            return _cuda_ext().write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        except RuntimeError as exc:
            _warn_once(f"cuda kv-cache write unavailable ({exc}); using {_fallback_backend(key.device)}")
            backend = _fallback_backend(key.device)
    if backend == "flash":  # FlashAttention has no cache write of its own
        backend = _fallback_backend(key.device)
    if backend == "cpu":
        if _cpu_usable():  # a memcpy per row: 2 us for a 16-token decode step against index_copy_'s 11 us
            return _cpu_ext().write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        backend = "torch"
    if backend == "triton":
        return _triton().write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    if backend != "torch":
        raise ValueError(f"unknown attention backend {backend!r}")
    return torch_native.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, *, max_query_len: int, max_seq_len: int,
                    seq_lens_list: list[int] | None = None, query_lens_list: list[int] | None = None,
                    backend: str = "torch", finite_cache: bool = False,
                    rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal paged attention of packed varlen queries [T, H, D]; see reference.paged_attention.

    finite_cache: the caller guarantees that cache slots no sequence uses hold finite values (a zero-initialized
    cache), which lets the torch backend skip masking them out of the value gather.
    rows: decode_rows(...) for this step, where uses_decode_rows says so (computed once per step, not per layer).
    """
    if backend == "reference":
        return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, scale)
    if backend == "cuda":
        out = _cuda_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, max_query_len,
                           max_seq_len)
        if out is not None:
            return out
        backend = _fallback_backend(query.device)
    if backend == "flash":
        flash = _flash()
        if flash.supports(key_cache.shape[1], query.dtype):
            return flash.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, scale, max_query_len=max_query_len,
                                         max_seq_len=max_seq_len)
        _warn_once(f"flash: block size {key_cache.shape[1]} / {query.dtype} unsupported; using triton")
        backend = _fallback_backend(query.device)
    if backend == "triton":
        return _triton().paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, scale, max_query_len=max_query_len,
                                         max_seq_len=max_seq_len)
    decode_fn = None
    if backend == "cpu":
        if _cpu_usable():
            if max_query_len == 1 and query.shape[0] == seq_lens.shape[0]:  # pure decode: skip the row split
                return _cpu_ext().paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
            if rows is not None:
                return _cpu_ext().paged_decode(query, key_cache, value_cache, rows[0], rows[1], scale)
            decode_fn = _cpu_decode_batch
        backend = "torch"
    if backend != "torch":
        raise ValueError(f"unknown attention backend {backend!r}")
    return torch_native.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                        query_start_loc,
                                        scale, seq_lens_list=seq_lens_list, query_lens_list=query_lens_list,
                                        finite_cache=finite_cache, decode_fn=decode_fn)


def uses_decode_rows(backend: str, max_query_len: int) -> bool:
    """Whether paged_attention wants decode_rows for a step with chunks of up to max_query_len tokens."""
    return backend == "cpu" and 1 < max_query_len <= MAX_CHUNK_AS_DECODE_ROWS and _cpu_usable()


def decode_rows(block_tables: torch.Tensor, query_lens: list[int],
                seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row as its own decode: (block table per row, context length per row).

    Row j of a q-token chunk whose context ends at s attends to the first s - q + 1 + j tokens (causal), so a
    mixed step becomes one decode-kernel call over the packed rows, reading K/V blocks in place.
    """
    index: list[int] = []
    lens: list[int] = []
    for i, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        index += [i] * q_len
        lens += range(seq_len - q_len + 1, seq_len + 1)
    rows = torch.tensor(index, dtype=torch.long, device=block_tables.device)
    return (block_tables.index_select(0, rows),
            torch.tensor(lens, dtype=torch.int32, device=block_tables.device))


def _cpu_usable() -> bool:
    """Whether the CPU kernel loads; warns once (and the caller uses torch) where it does not."""
    try:
        _cpu_ext().load()
    except RuntimeError as exc:
        _warn_once(f"cpu attention kernel unavailable ({exc}); using torch")
        return False
    return True


def _cpu_decode_batch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens_list: list[int], scale: float,
                      finite_cache: bool = False) -> torch.Tensor:
    """torch_native.DecodeFn on the C++ kernel (which never reads unused slots, so finite_cache is moot)."""
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32, device=query.device)
    return _cpu_ext().paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)


def _cuda_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int,
                 max_seq_len: int) -> torch.Tensor | None:
    """The CUDA decode kernel's answer, or None when this step is not one it handles."""
    decode_only = max_query_len == 1 and query.shape[0] == seq_lens.shape[0]
    cuda_ext = _cuda_ext()
    if not decode_only or not cuda_ext.supports(query.dtype, query.shape[2]):
        return None
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    try:
        return cuda_ext.paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                     max_seq_len)
    except RuntimeError as exc:
        if "unavailable" not in str(exc) and "Error building" not in str(exc):
            raise
        _warn_once(f"cuda decode kernel unavailable ({exc}); using {_fallback_backend(query.device)}")
        return None
