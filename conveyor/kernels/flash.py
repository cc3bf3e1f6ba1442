"""Optional backend: FlashAttention's varlen kernel reading the paged cache through `block_table`.

Uses vllm_flash_attn (vLLM's fork) when importable, else flash_attn (>= 2.5, which added `block_table`). Never
a required dependency. API differences, checked against the public sources:
- vllm_flash_attn.flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
  seqused_k=None, ..., block_table=None, ...): with a block table it takes per-sequence key lengths `seqused_k`;
  paged block size must be a multiple of 16.
- flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...,
  block_table=None): key lengths as cumulative `cu_seqlens_k`; upstream requires the paged block size to be a
  multiple of 256.
Both take window_size=(left, right) (key j visible to query i when i - left <= j <= i + right: a sliding window
W is (W - 1, 0), and the kernel skips blocks before it) and, from flash_attn 2.6, softcap (0: none).
Both align the causal mask bottom-right (query j of a q_len chunk sees keys up to seq_len - q_len + j), which
is the reference's convention. Keyword arguments throughout, since the positional orders differ.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable

import torch


@functools.cache
def _impl() -> tuple[str, Callable] | None:
    for module in ("vllm_flash_attn", "flash_attn"):
        try:
            mod = importlib.import_module(module)
            fn = mod.flash_attn_varlen_func
        except (ImportError, AttributeError, OSError, RuntimeError):
            continue  # a wheel built for another torch fails at import with OSError/RuntimeError
        if "block_table" in inspect.signature(fn).parameters:
            return module, fn
    return None


def is_available() -> bool:
    return _impl() is not None and torch.cuda.is_available()


def block_size_multiple() -> int:
    """Paged block-size granularity the installed implementation accepts."""
    impl = _impl()
    return 16 if impl is not None and impl[0] == "vllm_flash_attn" else 256


def supports(block_size: int, dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16) and block_size % block_size_multiple() == 0


def options_unsupported(sliding_window: int | None, logits_soft_cap: float | None) -> str | None:
    """Why the installed implementation cannot honour these options, or None when it can (or none is set)."""
    impl = _impl()
    if impl is None:
        return None  # nothing installed: the backend is unavailable anyway
    params = inspect.signature(impl[1]).parameters
    if sliding_window is not None and "window_size" not in params:
        return f"{impl[0]}.flash_attn_varlen_func has no window_size"
    if logits_soft_cap is not None and "softcap" not in params:
        return f"{impl[0]}.flash_attn_varlen_func has no softcap (flash_attn >= 2.6 has)"
    return None


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, *, max_query_len: int, max_seq_len: int, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> torch.Tensor:
    """Same contract as reference.paged_attention (fp16/bf16 only, as FlashAttention)."""
    reason = options_unsupported(sliding_window, logits_soft_cap)
    if reason is not None:
        raise ValueError(f"flash backend: {reason}")
    impl = _impl()
    if impl is None:
        raise RuntimeError("flash backend unavailable: neither vllm_flash_attn nor flash_attn is importable")
    _, fn = impl
    params = inspect.signature(fn).parameters
    kwargs = dict(q=query, k=key_cache, v=value_cache, cu_seqlens_q=query_start_loc,
                  max_seqlen_q=max_query_len,
                  max_seqlen_k=max_seq_len, softmax_scale=scale, causal=True, block_table=block_tables)
    if sliding_window is not None:
        kwargs["window_size"] = (sliding_window - 1, 0)
    if logits_soft_cap is not None:
        kwargs["softcap"] = logits_soft_cap
    if "seqused_k" in params:
        kwargs["seqused_k"] = seq_lens
        if "cu_seqlens_k" in params and params["cu_seqlens_k"].default is inspect.Parameter.empty:
            kwargs["cu_seqlens_k"] = _cumulative(seq_lens)
    else:
        kwargs["cu_seqlens_k"] = _cumulative(seq_lens)
    return fn(**kwargs)


def _cumulative(seq_lens: torch.Tensor) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as int32: flash_attn's paged path reads key lengths as differences."""
    out = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    torch.cumsum(seq_lens, 0, out=out[1:])
    return out
