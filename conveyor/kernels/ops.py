"""One dispatch point for attention kernels. Imports nothing of Conveyor's outside conveyor.kernels.

Backends:
- "reference": reference.py, the truth (slow, one sequence at a time).
- "torch": torch_native.py, vectorized torch; the CPU fallback when the C++ kernel cannot be built.
- "cpu": our C++ kernels (csrc/cpu/, JIT-built by cpu_ext.py): the decode kernel for decode rows and short
  prefill chunks, the prefill kernel for longer chunks (the split: cpu_plan.py), and the KV-cache write. The CPU
  default when it builds; torch where it does not.
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

from conveyor.kernels import cpu_plan, reference, torch_native
from conveyor.kernels.cpu_plan import CpuStepPlan

BACKENDS = ("reference", "torch", "cpu", "triton", "cuda", "flash")


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


# The backends with a reader for an fp8 KV cache (triton's kernels and CUDA's have none).
FP8_CACHE_BACKENDS = ("cpu", "torch")


def _fp8_backend(backend: str, cache_dtype: torch.dtype) -> str:
    """Backends outside FP8_CACHE_BACKENDS send a step over an fp8 cache to torch."""
    if cache_dtype in reference.FP8_DTYPES and backend not in FP8_CACHE_BACKENDS:
        _warn_once(f"{backend}: no {cache_dtype} KV cache reader; using torch")
        return "torch"
    return backend


def check_options(backend: str, sliding_window: int | None = None,
                  logits_soft_cap: float | None = None) -> None:
    """ValueError for an attention option out of range, or one `backend` cannot honour. Every backend's kernels
    take a sliding window and soft cap (and every fallback between backends keeps them); only an installed
    FlashAttention too old for them cannot."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) != sliding_window
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be positive or None, got {logits_soft_cap!r}")
    if backend not in ("auto",) + BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {('auto',) + BACKENDS}")
    if backend == "flash" and (sliding_window is not None or logits_soft_cap is not None):
        reason = _flash().options_unsupported(sliding_window, logits_soft_cap)
        if reason is not None:
            raise ValueError(f"attention backend {backend!r} cannot honour the options: {reason}")


def _fallback_backend(device: torch.device) -> str:
    """Where cuda/flash send the steps they cannot run."""
    return "triton" if _triton_usable(device) else "torch"


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "torch") -> None:
    """cache[slot // block_size, slot % block_size] = key/value rows; slot < 0 skips the token."""
    if backend == "reference":
        return reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    backend = _fp8_backend(backend, key_cache.dtype)
    if backend == "cuda" and key.dtype != key_cache.dtype:  # the CUDA write copies rows, it does not convert
        backend = _fallback_backend(key.device)
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
                    plan: CpuStepPlan | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """Causal paged attention of packed varlen queries [T, H, D]; see reference.paged_attention.

    sliding_window W: a query at position p attends keys p - W < j <= p (transformers' mask); blocks wholly
    before every query's window are never read. logits_soft_cap c: scores = c * tanh(scores / c) (Gemma 2).

    finite_cache: the caller guarantees that cache slots no sequence uses hold finite values (a zero-initialized
    cache), which lets the torch backend skip masking them out of the value gather.
    plan: cpu_step_plan(...) for this step, where uses_cpu_plan says so (made once per step, not per layer).
    """
    if backend == "reference":
        return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, scale, sliding_window=sliding_window,
                                         logits_soft_cap=logits_soft_cap)
    backend = _fp8_backend(backend, key_cache.dtype)
    if backend == "cuda":
        out = _cuda_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, max_query_len,
                           max_seq_len, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        if out is not None:
            return out
        backend = _fallback_backend(query.device)
    if backend == "flash":
        flash = _flash()
        if flash.supports(key_cache.shape[1], query.dtype) and key_cache.dtype == query.dtype:
            return flash.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, scale, max_query_len=max_query_len,
                                         max_seq_len=max_seq_len, sliding_window=sliding_window,
                                         logits_soft_cap=logits_soft_cap)
        _warn_once(f"flash: block size {key_cache.shape[1]} / {query.dtype} query / {key_cache.dtype} cache "
                   "unsupported; using triton")
        backend = _fallback_backend(query.device)
    if backend == "triton":
        return _triton().paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, scale, max_query_len=max_query_len,
                                         max_seq_len=max_seq_len, sliding_window=sliding_window,
                                         logits_soft_cap=logits_soft_cap)
    if backend == "cpu":
        if _cpu_usable():
            options = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap}
            if max_query_len == 1 and query.shape[0] == seq_lens.shape[0]:  # pure decode: skip the row split
                return _cpu_ext().paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                               **options)
            if plan is None:
                plan = cpu_step_plan(block_tables, query_start_loc, seq_lens, query_lens_list, seq_lens_list)
            return cpu_plan.run_plan(_cpu_ext(), query, key_cache, value_cache, plan, scale, **options)
        backend = "torch"
    if backend != "torch":
        raise ValueError(f"unknown attention backend {backend!r}")
    return torch_native.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                        query_start_loc,
                                        scale, seq_lens_list=seq_lens_list, query_lens_list=query_lens_list,
                                        finite_cache=finite_cache, sliding_window=sliding_window,
                                        logits_soft_cap=logits_soft_cap)


def uses_cpu_plan(backend: str, max_query_len: int) -> bool:
    """Whether paged_attention wants a cpu_step_plan for a step whose longest chunk is max_query_len tokens."""
    return backend == "cpu" and max_query_len > 1 and _cpu_usable()


def cpu_step_plan(block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  query_lens_list: list[int] | None = None, seq_lens_list: list[int] | None = None,
                  max_rows_chunk: int = cpu_plan.MAX_CHUNK_AS_DECODE_ROWS) -> CpuStepPlan:
    """The split of one step between the CPU decode and prefill kernels (cpu_plan.py); the lists spare a sync."""
    if query_lens_list is None:
        query_lens_list = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    if seq_lens_list is None:
        seq_lens_list = seq_lens.tolist()
    return cpu_plan.plan_step(block_tables, query_lens_list, seq_lens_list, max_rows_chunk)


def _cpu_usable() -> bool:
    """Whether the CPU kernel loads; warns once (and the caller uses torch) where it does not."""
    try:
        _cpu_ext().load()
    except RuntimeError as exc:
        _warn_once(f"cpu attention kernel unavailable ({exc}); using torch")
        return False
    return True


def _cuda_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int,
                 max_seq_len: int, **options) -> torch.Tensor | None:
    """The CUDA decode kernel's answer, or None when this step is not one it handles."""
    decode_only = max_query_len == 1 and query.shape[0] == seq_lens.shape[0]
    cuda_ext = _cuda_ext()
    if not decode_only or not cuda_ext.supports(query.dtype, query.shape[2]) or key_cache.dtype != query.dtype:
        return None
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return None
    try:
        return cuda_ext.paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                     max_seq_len, **options)
    except RuntimeError as exc:
        if "unavailable" not in str(exc) and "Error building" not in str(exc):
            raise
        _warn_once(f"cuda decode kernel unavailable ({exc}); using {_fallback_backend(query.device)}")
        return None
