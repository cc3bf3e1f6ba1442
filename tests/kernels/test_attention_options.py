"""Sliding-window attention and logit soft-capping: the reference against transformers' own mask, then every
backend that runs here against the reference (decode and mixed prefill steps, windows shorter and longer than
the context, soft cap on and off). Blocks wholly before a window are unmapped (BAD_BLOCK), as the engine frees
them: a backend that reads them fails."""
from __future__ import annotations

import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from conveyor.kernels import ops, reference
from conveyor.serving.attention import PagedAttention
from tests.cpu_ext_gate import cpu_ext_expected
from tests.kernels.cases import (
    BAD_BLOCK,
    DECODE_SPECS,
    MIXED_SPECS,
    TOL,
    WINDOW_SPECS,
    WINDOWS,
    make_case,
    rel_err,
)

BACKENDS = ["torch"] + (["cpu"] if cpu_ext_expected() else [])
SPECS = {"mixed": MIXED_SPECS, "decode": DECODE_SPECS, "long": WINDOW_SPECS}


def _dense(case, window: int | None, cap: float | None) -> torch.Tensor:  # noqa: ANN001 - PagedCase
    """Attention written out densely with transformers' sliding-window mask function, one sequence at a time."""
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    block_size, group = case.key_cache.shape[1], case.query.shape[1] // case.key_cache.shape[2]
    starts = case.query_start_loc.tolist()
    for i, (q_len, seq_len) in enumerate(zip(case.query_lens_list, case.seq_lens_list, strict=True)):
        if q_len == 0:
            continue
        table = case.block_tables[i].tolist()
        keys = torch.stack([case.key_cache[table[p // block_size], p % block_size] if table[p // block_size]
                            != BAD_BLOCK else torch.zeros_like(case.key_cache[0, 0]) for p in range(seq_len)])
        values = torch.stack([case.value_cache[table[p // block_size], p % block_size] if table[p // block_size]
                              != BAD_BLOCK else torch.zeros_like(case.value_cache[0, 0]) for p in range(seq_len)])
        keys, values = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
        q = case.query[starts[i]:starts[i + 1]].double()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * case.scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        visible = torch.zeros(q_len, seq_len, dtype=torch.bool)
        for j in range(q_len):
            p = seq_len - q_len + j
            for k in range(seq_len):
                visible[j, k] = (k <= p) if window is None else bool(
                    sliding_window_causal_mask_function(window)(0, 0, torch.tensor(p), torch.tensor(k)))
        scores = scores.masked_fill(~visible, float("-inf"))
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values)
    return out


@pytest.mark.parametrize(("window", "cap"), [(5, None), (1, None), (None, 2.0), (4, 3.0)])
def test_reference_matches_transformers_mask(window: int | None, cap: float | None) -> None:
    """The window's off-by-one is transformers': query p sees keys p - window < k <= p."""
    case = make_case([(1, 11), (6, 9), (4, 4)], 4, 2, head_dim=8, block_size=2, sliding_window=window,
                     logits_soft_cap=cap)
    ref = reference.paged_attention(*case.to(torch.float64).args(), **case.options())
    assert rel_err(ref, _dense(case.to(torch.float64), window, cap)) < 1e-6  # the reference computes in fp32


def test_window_longer_than_context_is_full_attention() -> None:
    case = make_case(MIXED_SPECS, 4, 2, head_dim=8, block_size=4)
    full = reference.paged_attention(*case.args())
    assert torch.equal(reference.paged_attention(*case.args(), sliding_window=1000), full)
    assert rel_err(reference.paged_attention(*case.args(), sliding_window=3), full) > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("specs", list(SPECS.values()), ids=list(SPECS))
@pytest.mark.parametrize(("window", "cap"), [(WINDOWS[0], None), (WINDOWS[2], None), (None, 5.0), (WINDOWS[1], 5.0)])
def test_backend_matches_reference(backend: str, block_size: int, specs: list[tuple[int, int]],
                                   window: int | None, cap: float | None) -> None:
    case = make_case(specs, 8, 2, head_dim=16, block_size=block_size, seed=block_size, sliding_window=window,
                     logits_soft_cap=cap)
    out = ops.paged_attention(*case.args(), **case.kwargs(), backend=backend)
    assert rel_err(out, reference.paged_attention(*case.to(torch.float64).args(), **case.options())) < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backend_low_precision(backend: str, dtype: torch.dtype) -> None:
    case = make_case(WINDOW_SPECS, 4, 4, head_dim=32, block_size=8, dtype=dtype, sliding_window=10,
                     logits_soft_cap=20.0)
    out = ops.paged_attention(*case.args(), **case.kwargs(), backend=backend)
    assert out.dtype == dtype
    assert rel_err(out, reference.paged_attention(*case.to(torch.float64).args(), **case.options())) < TOL[dtype]


def test_paged_attention_layer_options() -> None:
    """PagedAttention carries scale, window and cap to the kernels; bad values fail at construction."""
    layer = PagedAttention(4, 2, 8, "torch", scale=0.5, sliding_window=6, logits_soft_cap=3.0)
    assert (layer.scale, layer.sliding_window, layer.logits_soft_cap) == (0.5, 6, 3.0)
    assert PagedAttention(4, 2, 16).scale == 16 ** -0.5
    for bad in ({"sliding_window": 0}, {"sliding_window": 2.5}, {"logits_soft_cap": 0.0},
                {"logits_soft_cap": -1.0}):
        with pytest.raises(ValueError):
            PagedAttention(4, 2, 8, "torch", **bad)
    with pytest.raises(ValueError, match="unknown attention backend"):
        PagedAttention(4, 2, 8, "tensorrt")


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the CPU extension cannot be built here")
@pytest.mark.parametrize(("window", "cap"), [(50, None), (130, 10.0), (1000, None)])
def test_cpu_long_contexts(window: int, cap: float | None) -> None:
    """Windows across the prefill kernel's 64-key tiles and its query tiles, and a decode whose context the
    decode kernel splits into partitions (a lone long sequence), the first starting mid-block."""
    case = make_case([(100, 300), (70, 70), (1, 1500), (1, 900)], 8, 2, head_dim=64, block_size=16, seed=5,
                     sliding_window=window, logits_soft_cap=cap)
    out = ops.paged_attention(*case.args(), **case.kwargs(), backend="cpu")
    assert rel_err(out, reference.paged_attention(*case.to(torch.float64).args(), **case.options())) < 1e-4
    decode = make_case([(1, 2000)], 8, 2, head_dim=64, block_size=16, seed=6, sliding_window=window,
                       logits_soft_cap=cap)
    out = ops.paged_attention(*decode.args(), **decode.kwargs(), backend="cpu")
    assert rel_err(out, reference.paged_attention(*decode.to(torch.float64).args(), **decode.options())) < 1e-4


@pytest.mark.parametrize(("block_size", "window", "cap"), [(1, 3, None), (4, 3, None), (4, 8, 5.0), (16, None, 5.0)])
def test_triton_matches_reference(block_size: int, window: int | None, cap: float | None) -> None:
    """Triton's kernel (its CPU interpreter here, compiled on a GPU) on decodes and chunks beside each other."""
    if "triton" not in ops.available_backends("cuda" if torch.cuda.is_available() else "cpu"):
        pytest.skip("triton not importable or not interpreting")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case(WINDOW_SPECS, 4, 2, head_dim=16, block_size=block_size, seed=block_size, device=device,
                     sliding_window=window, logits_soft_cap=cap)
    out = ops.paged_attention(*case.args(), **case.kwargs(), backend="triton")
    ref = reference.paged_attention(*case.to(torch.float64).args(), **case.options())
    assert rel_err(out.cpu(), ref.cpu()) < 1e-4


def test_flash_gets_window_and_softcap(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash_attn_varlen_func receives window_size=(window - 1, 0) (its window counts keys left of the query)
    and softcap; an installed version without softcap fails at construction, not silently."""
    from conveyor.kernels import flash

    seen: dict = {}

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,  # noqa: ANN001, ANN202
               causal=False, window_size=(-1, -1), softcap=0.0, block_table=None):
        seen.update(window_size=window_size, softcap=softcap)
        return q

    monkeypatch.setattr(flash, "_impl", lambda: ("flash_attn", varlen))
    case = make_case(DECODE_SPECS, 4, 2, head_dim=8, block_size=4, sliding_window=6, logits_soft_cap=2.0)
    flash.paged_attention(*case.args(), max_query_len=1, max_seq_len=33, **case.options())
    assert seen == {"window_size": (5, 0), "softcap": 2.0}
    PagedAttention(4, 2, 8, "flash", sliding_window=6, logits_soft_cap=2.0)  # accepted

    def old_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_size=(-1, -1),  # noqa: ANN001, ANN202
                   block_table=None):
        return q

    monkeypatch.setattr(flash, "_impl", lambda: ("flash_attn", old_varlen))
    with pytest.raises(ValueError, match="softcap"):
        PagedAttention(4, 2, 8, "flash", logits_soft_cap=2.0)
    PagedAttention(4, 2, 8, "flash", sliding_window=6)
