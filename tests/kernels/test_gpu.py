"""Every GPU backend against reference.py on fresh random inputs, outputs poisoned with NaN (marker `gpu`).

The reference runs in float64 on upcast inputs; kernels run in fp32 (where they have it) and bf16. Skipped
without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from conveyor.kernels import ops, reference
from tests.kernels.cases import MIXED_SPECS, TOL, make_case, make_kv_write, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DECODE_LONG = [(1, 1), (1, 17), (1, 600), (1, 1500), (1, 2049), (1, 33)]


def _backends() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [b for b in ops.available_backends("cuda") if b != "reference"]


def _run(backend: str, case, **extra) -> torch.Tensor:  # noqa: ANN001 - PagedCase
    return ops.paged_attention(*case.args(), **case.kwargs(), backend=backend, **extra)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (32, 8), (9, 3)])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("specs", [MIXED_SPECS, DECODE_LONG], ids=["mixed", "decode"])
def test_backend_matches_reference(backend: str, dtype: torch.dtype, heads: tuple[int, int], block_size: int,
                                   specs: list[tuple[int, int]]) -> None:
    seed = torch.randint(0, 1 << 30, ()).item()  # fresh inputs every run
    case = make_case(specs, *heads, head_dim=128 if heads[0] != 9 else 64, block_size=block_size,
                     dtype=dtype, device="cuda", seed=seed)
    ref = reference.paged_attention(*case.to(torch.float64).args())
    out = _run(backend, case)
    torch.cuda.synchronize()
    assert out.shape == case.query.shape and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype], f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_partitions", [1, 2, 5])
def test_cuda_split_k(dtype: torch.dtype, num_partitions: int) -> None:
    """Forced split-K with partitions of 512 (and of 64) against the reference, output poisoned."""
    cuda_ext = pytest.importorskip("conveyor.kernels.cuda_ext")
    if not cuda_ext.is_available():
        pytest.skip(cuda_ext.unavailable_reason())
    seed = torch.randint(0, 1 << 30, ()).item()
    case = make_case(DECODE_LONG, 32, 8, head_dim=128, block_size=16, dtype=dtype, device="cuda", seed=seed)
    ref = reference.paged_attention(*case.to(torch.float64).args())
    for partition_size in (512, 64):
        parts = max(num_partitions, -(-max(case.seq_lens_list) // partition_size))
        out = torch.full_like(case.query, float("nan"))
        cuda_ext.paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                              case.scale, max(case.seq_lens_list), out=out, num_partitions=parts,
                              partition_size=partition_size)
        torch.cuda.synchronize()
        assert rel_err(out, ref) < TOL[dtype], (seed, partition_size, parts)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache(backend: str, dtype: torch.dtype) -> None:
    seed = torch.randint(0, 1 << 30, ()).item()
    key, value, kc, vc, slots = make_kv_write(37, 8, 128, 16, num_blocks=9, dtype=dtype, device="cuda",
                                              seed=seed)
    kc_ref, vc_ref = kc.cpu(), vc.cpu()
    reference.write_kv_cache(key.cpu(), value.cpu(), kc_ref, vc_ref, slots.cpu())
    ops.write_kv_cache(key, value, kc, vc, slots, backend=backend)
    torch.cuda.synchronize()
    assert torch.equal(kc.cpu(), kc_ref) and torch.equal(vc.cpu(), vc_ref)


def test_auto_picks_gpu_backend() -> None:
    assert ops.resolve_backend("auto", "cuda") in ("flash", "cuda", "triton")


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("specs", [MIXED_SPECS, DECODE_LONG], ids=["mixed", "decode"])
def test_backend_reads_a_bf16_cache_under_fp32_queries(backend: str, specs: list[tuple[int, int]]) -> None:
    """kv_cache_dtype bfloat16 on a float32 model: cuda and flash hand such steps to triton (ops.py); every backend
    must equal the reference on the values the cache holds, at float32's tolerance."""
    seed = torch.randint(0, 1 << 30, ()).item()
    case = make_case(specs, 32, 8, head_dim=128, block_size=16, device="cuda", seed=seed)
    case.key_cache, case.value_cache = case.key_cache.bfloat16(), case.value_cache.bfloat16()
    ref = reference.paged_attention(*case.to(torch.float64).args())
    out = _run(backend, case)
    torch.cuda.synchronize()
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < TOL[torch.float32], f"seed {seed}"
    key, value, kc, vc, slots = make_kv_write(9, 8, 128, 16, num_blocks=4, device="cuda")
    kc, vc = kc.bfloat16(), vc.bfloat16()
    ops.write_kv_cache(key, value, kc, vc, slots, backend=backend)
    written = slots >= 0
    flat = kc.view(-1, 8, 128)
    torch.testing.assert_close(flat[slots[written]].float(), key[written].bfloat16().float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize(("window", "cap"), [(100, None), (700, 30.0), (None, 30.0)])
@pytest.mark.parametrize("specs", [MIXED_SPECS + [(40, 300)], DECODE_LONG], ids=["mixed", "decode"])
def test_backend_options(backend: str, window: int | None, cap: float | None, specs: list[tuple[int, int]]) -> None:
    """Sliding window and soft cap; blocks wholly before a window are unmapped (BAD_BLOCK): reading one faults."""
    seed = torch.randint(0, 1 << 30, ()).item()
    case = make_case(specs, 32, 8, head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda", seed=seed,
                     sliding_window=window, logits_soft_cap=cap)
    ref = reference.paged_attention(*case.to(torch.float64).args(), **case.options())
    out = _run(backend, case)
    torch.cuda.synchronize()
    assert rel_err(out, ref) < TOL[torch.bfloat16], f"seed {seed}"


@pytest.mark.parametrize("window", [100, 700])
def test_cuda_split_k_window(window: int) -> None:
    """Split-K partitions count from the window's first position."""
    cuda_ext = pytest.importorskip("conveyor.kernels.cuda_ext")
    if not cuda_ext.is_available():
        pytest.skip(cuda_ext.unavailable_reason())
    case = make_case(DECODE_LONG, 32, 8, head_dim=128, block_size=16, device="cuda", sliding_window=window,
                     logits_soft_cap=30.0)
    ref = reference.paged_attention(*case.to(torch.float64).args(), **case.options())
    out = torch.full_like(case.query, float("nan"))
    cuda_ext.paged_decode(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                          case.scale, max(case.seq_lens_list), out=out, num_partitions=-(-window // 64),
                          partition_size=64, **case.options())
    torch.cuda.synchronize()
    assert rel_err(out, ref) < TOL[torch.float32]
