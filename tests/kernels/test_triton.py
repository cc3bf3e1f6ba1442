"""Triton kernels against reference.py: in the CPU interpreter here (conftest sets TRITON_INTERPRET=1),
compiled on a GPU when one is present. The interpreter costs ~2 ms per program, so shapes stay tiny."""
from __future__ import annotations

import pytest
import torch

from conveyor.kernels import reference
from tests.kernels.cases import DECODE_SPECS, MIXED_SPECS, TOL, make_case, make_kv_write, rel_err

triton_attention = pytest.importorskip("conveyor.kernels.triton_attention")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(case, dtype: torch.dtype, **kw) -> None:  # noqa: ANN001 - PagedCase
    ref = reference.paged_attention(*case.to(torch.float64).args())
    out = torch.full_like(case.query, float("nan"))  # poisoned: every row must be written
    res = triton_attention.paged_attention(*case.args(), **case.kwargs(), out=out, **kw)
    assert res is out
    assert rel_err(out.cpu(), ref.cpu()) < TOL[dtype]


@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_step(heads: tuple[int, int], block_size: int) -> None:
    """Prefill chunks (one starting inside a block) beside decodes and an idle sequence, GQA 1/2/4."""
    case = make_case(MIXED_SPECS, *heads, head_dim=16, block_size=block_size, device=DEVICE, seed=block_size)
    _check(case, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_dtypes(dtype: torch.dtype) -> None:
    case = make_case(DECODE_SPECS, 4, 2, head_dim=16, block_size=4, dtype=dtype, device=DEVICE, seed=7)
    _check(case, dtype)


def test_small_tiles_many_steps() -> None:
    """Tiny tiles: several query tiles per sequence and several KV steps, head_dim not a power of two."""
    case = make_case([(7, 20), (1, 9), (3, 3)], 6, 2, head_dim=12, block_size=2, device=DEVICE, seed=5)
    _check(case, torch.float32, block_m=2, block_n=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4])
def test_write_kv_cache(dtype: torch.dtype, block_size: int) -> None:
    key, value, kc, vc, slots = make_kv_write(7, 3, 12, block_size, num_blocks=10, dtype=dtype, device=DEVICE)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    reference.write_kv_cache(key, value, kc_ref, vc_ref, slots)
    triton_attention.write_kv_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_write_kv_cache_strided_input() -> None:
    """key/value as views into a fused qkv tensor (token stride larger than KVH * D)."""
    qkv = torch.randn(5, 4 + 2 + 2, 8, device=DEVICE)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    kc = torch.zeros(4, 4, 2, 8, device=DEVICE)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, -1, 0, 15, 7], device=DEVICE)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    reference.write_kv_cache(key, value, kc_ref, vc_ref, slots)
    triton_attention.write_kv_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
