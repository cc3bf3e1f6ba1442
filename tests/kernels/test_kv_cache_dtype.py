"""A KV cache narrower than the model (kv_cache_dtype): float32 queries over a bfloat16, float16 or fp8 cache.

Every backend that accepts the pair must equal the float64 reference computed on the very values the cache holds
(widening bf16/fp16/fp8 to float64 is exact), so the tolerance is float32's, not bf16's: the kernels may not lose
more than the cache's own rounding. The cache write must round each row like torch's own conversion, and fp8
saturates at its largest finite value (torch's e5m2 conversion gives inf).
"""
from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu_ext, ops, reference
from conveyor.kernels.reference import FP8_DTYPES, to_cache_dtype
from tests.cpu_ext_gate import cpu_ext_expected, require_cpu_ext
from tests.kernels.cases import DECODE_SPECS, MIXED_SPECS, TOL, PagedCase, make_case, make_kv_write, rel_err

HALF = [torch.bfloat16, torch.float16]
NARROW = [*HALF, *FP8_DTYPES]


def _narrow_cache(case: PagedCase, cache_dtype: torch.dtype) -> PagedCase:
    case.key_cache = to_cache_dtype(case.key_cache, cache_dtype)
    case.value_cache = to_cache_dtype(case.value_cache, cache_dtype)
    return case


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """torch has no fp8 equality on CPU: compare the bytes."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def _reference(case: PagedCase) -> torch.Tensor:
    return reference.paged_attention(*case.to(torch.float64).args())


def _backends() -> list[str]:
    names = ["torch"]
    if cpu_ext_expected():  # a failed build then fails the "cpu" cases instead of dropping them
        names.append("cpu")
    if "triton" in ops.available_backends("cpu"):  # under TRITON_INTERPRET=1 only
        names.append("triton")
    return names


@pytest.mark.parametrize("cache_dtype", NARROW)
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2), (14, 2)])  # groups 1, 3, 4 and 7 (two chunks)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 40])  # 40: the generic path
def test_cpu_decode_reads_a_narrow_cache(cache_dtype: torch.dtype, heads: tuple[int, int], head_dim: int) -> None:
    require_cpu_ext()
    lens = [1, 15, 16, 17, 300, 700]
    case = _narrow_cache(make_case([(1, n) for n in lens], *heads, head_dim=head_dim, block_size=16,
                                   seed=head_dim), cache_dtype)
    out = cpu_ext.paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                               case.scale)
    assert out.dtype == torch.float32
    assert rel_err(out, _reference(case)) < TOL[torch.float32]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8_DTYPES])
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("specs", [MIXED_SPECS, DECODE_SPECS, [(80, 80), (1, 33)], [(16, 700), (1, 300)]],
                         ids=["mixed", "decode", "prefill-and-decode", "chunk-over-long-context"])
def test_backends_read_a_narrow_cache(backend: str, specs: list[tuple[int, int]], cache_dtype: torch.dtype) -> None:
    """(triton sends fp8 steps to torch: ops._fp8_backend.)"""
    case = _narrow_cache(make_case(specs, 9, 3, head_dim=64, block_size=16, seed=len(specs)), cache_dtype)
    out = ops.paged_attention(*case.args(), **case.kwargs(), backend=backend, finite_cache=False)
    assert out.dtype == torch.float32 and out.shape == case.query.shape
    assert rel_err(out, _reference(case)) < TOL[torch.float32]


@pytest.mark.parametrize("cache_dtype", HALF)
def test_bf16_queries_over_an_fp32_cache(cache_dtype: torch.dtype) -> None:
    """The other way round (a model in bf16/fp16 with a float32 cache) is a valid pair too."""
    require_cpu_ext()
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
    if cache_dtype in FP8_DTYPES:
        key[2, 0, :3] = torch.tensor([1e5, -1e5, 500.0])  # past the range: saturates
        value[4, 1, 0] = 1e-3  # an e4m3 subnormal
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    want_k, want_v = kc.clone(), vc.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            want_k.view(-1, 2, 8)[slot] = to_cache_dtype(key[t], cache_dtype)
            want_v.view(-1, 2, 8)[slot] = to_cache_dtype(value[t], cache_dtype)
    assert want_k.float().isfinite().all()
    ops.write_kv_cache(key, value, kc, vc, slots, backend=backend)
    assert kc.dtype == cache_dtype
    if cache_dtype in FP8_DTYPES:
        limit = torch.finfo(cache_dtype).max
        assert kc.view(-1, 2, 8)[slots[2]][0, :2].float().tolist() == [limit, -limit]
    if backend == "triton" and cache_dtype not in FP8_DTYPES:  # the interpreter truncates where a GPU rounds
        ulp = torch.finfo(cache_dtype).eps
        for got, want in ((kc, want_k), (vc, want_v)):
            assert torch.allclose(got.float(), want.float(), rtol=ulp, atol=0)
        return
    assert torch.equal(_bytes(kc), _bytes(want_k)) and torch.equal(_bytes(vc), _bytes(want_v))


def test_write_converts_strided_rows() -> None:
    """Rows as the model hands them over (slices of a fused qkv projection) convert too."""
    require_cpu_ext()
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


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES)
def test_the_cpu_write_rounds_to_fp8_as_torch_does(cache_dtype: torch.dtype) -> None:
    """Every fp8 value, the ties between neighbours, values just off the ties, subnormals, zeros and values past
    the range: the kernel's vectorized rounding gives torch's bytes (saturated), 16 lanes and the scalar tail."""
    require_cpu_ext()
    grid = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    grid = grid[grid.isfinite()].unique()  # every finite fp8 value, both signs
    ties = (grid[1:] + grid[:-1]) / 2
    nudge = ties.abs() * 1e-6 + 1e-30
    big = torch.tensor([1e6, -1e6, torch.finfo(cache_dtype).max * 1.01, 3e38, -3e38, 0.0, -0.0, 1e-30, -1e-30])
    values = torch.cat([grid, ties, ties + nudge, ties - nudge, big, torch.randn(1000) * 10])
    row = 21  # 16 lanes and a tail of 5 for the scalar loop
    values = values[: values.numel() // row * row]
    key = values.view(-1, 1, row)
    kc = torch.zeros(key.shape[0], 1, 1, row, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    cpu_ext.write_kv_cache(key, key, kc, vc, torch.arange(key.shape[0]))
    want = to_cache_dtype(values, cache_dtype)
    assert torch.equal(kc.flatten().view(torch.uint8), want.view(torch.uint8))
