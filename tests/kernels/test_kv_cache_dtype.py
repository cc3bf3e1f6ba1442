"""A KV cache narrower than the model (kv_cache_dtype): float32 queries over a bfloat16 or float16 cache.

Every backend that accepts the pair must equal the float64 reference computed on the very values the cache holds
(widening bf16/fp16 to float64 is exact), so the tolerance is float32's, not bf16's: the kernels may not lose
more than the cache's own rounding. The cache write must round each row like torch's own conversion.
"""
from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu_ext, ops, reference
from tests.kernels.cases import DECODE_SPECS, MIXED_SPECS, TOL, PagedCase, make_case, make_kv_write, rel_err

NARROW = [torch.bfloat16, torch.float16]


def _narrow_cache(case: PagedCase, cache_dtype: torch.dtype) -> PagedCase:
    case.key_cache = case.key_cache.to(cache_dtype)
    case.value_cache = case.value_cache.to(cache_dtype)
    return case


def _reference(case: PagedCase) -> torch.Tensor:
    return reference.paged_attention(*case.to(torch.float64).args())


def _backends() -> list[str]:
    names = ["torch"]
    if cpu_ext.is_available():
        names.append("cpu")
    if "triton" in ops.available_backends("cpu"):  # under TRITON_INTERPRET=1 only
        names.append("triton")
    return names


@pytest.mark.parametrize("cache_dtype", NARROW)
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2), (14, 2)])  # groups 1, 3, 4 and 7 (two chunks)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 40])  # 40: the generic path
def test_cpu_decode_reads_a_narrow_cache(cache_dtype: torch.dtype, heads: tuple[int, int], head_dim: int) -> None:
    if not cpu_ext.is_available():
        pytest.skip("CPU extension cannot be built here")
    lens = [1, 15, 16, 17, 300, 700]
    case = _narrow_cache(make_case([(1, n) for n in lens], *heads, head_dim=head_dim, block_size=16,
                                   seed=head_dim), cache_dtype)
    out = cpu_ext.paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                               case.scale)
    assert out.dtype == torch.float32
    assert rel_err(out, _reference(case)) < TOL[torch.float32]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("specs", [MIXED_SPECS, DECODE_SPECS, [(80, 80), (1, 33)], [(16, 700), (1, 300)]],
                         ids=["mixed", "decode", "prefill-and-decode", "chunk-over-long-context"])
def test_backends_read_a_bf16_cache(backend: str, specs: list[tuple[int, int]]) -> None:
    case = _narrow_cache(make_case(specs, 9, 3, head_dim=64, block_size=16, seed=len(specs)), torch.bfloat16)
    out = ops.paged_attention(*case.args(), **case.kwargs(), backend=backend, finite_cache=False)
    assert out.dtype == torch.float32 and out.shape == case.query.shape
    assert rel_err(out, _reference(case)) < TOL[torch.float32]


@pytest.mark.parametrize("cache_dtype", NARROW)
def test_bf16_queries_over_an_fp32_cache(cache_dtype: torch.dtype) -> None:
    """The other way round (a model in bf16/fp16 with a float32 cache) is a valid pair too."""
    if not cpu_ext.is_available():
        pytest.skip("CPU extension cannot be built here")
    case = make_case([(1, n) for n in (3, 40, 300)], 9, 3, head_dim=64, block_size=16)
    case.query = case.query.to(cache_dtype)
    out = cpu_ext.paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                               case.scale)
    assert out.dtype == cache_dtype
    assert rel_err(out, _reference(case)) < TOL[cache_dtype]


@pytest.mark.parametrize("backend", ["reference", *_backends()])
@pytest.mark.parametrize("cache_dtype", NARROW)
def test_write_converts_rows_to_the_cache_dtype(backend: str, cache_dtype: torch.dtype) -> None:
    key, value, kc, vc, slots = make_kv_write(6, 2, 8, 4, num_blocks=4)
    slots[1] = -1  # a padding token is skipped
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    want_k, want_v = kc.clone(), vc.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k.view(-1, 2, 8)[slot] = key[t].to(cache_dtype)
            want_v.view(-1, 2, 8)[slot] = value[t].to(cache_dtype)
    ops.write_kv_cache(key, value, kc, vc, slots, backend=backend)
    assert kc.dtype == cache_dtype
    if backend == "triton":  # the interpreter's cast truncates where a GPU's rounds: within one unit
        ulp = torch.finfo(cache_dtype).eps
        for got, want in ((kc, want_k), (vc, want_v)):
            assert torch.allclose(got.float(), want.float(), rtol=ulp, atol=0)
        return
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_write_converts_strided_rows() -> None:
    """Rows as the model hands them over (slices of a fused qkv projection) convert too."""
    if not cpu_ext.is_available():
        pytest.skip("CPU extension cannot be built here")
    qkv = torch.randn(5, 8 * 8)
    _, key, value = qkv.split([4 * 8, 2 * 8, 2 * 8], dim=-1)
    key, value = key.view(5, 2, 8), value.view(5, 2, 8)
    kc, vc = torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16), torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16)
    slots = torch.tensor([3, -1, 0, 15, 8])
    cpu_ext.write_kv_cache(key, value, kc, vc, slots)
    flat = kc.view(-1, 2, 8)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], key[t].bfloat16())
