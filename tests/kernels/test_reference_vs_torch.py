"""The torch backend (CPU serving default) against reference.py."""
from __future__ import annotations

import pytest
import torch

from conveyor.kernels import ops, reference, torch_native
from tests.cpu_ext_gate import cpu_ext_expected
from tests.kernels.cases import DECODE_SPECS, MIXED_SPECS, TOL, make_case, make_kv_write, rel_err

GQA = [(4, 4), (4, 2), (8, 2)]  # (H, KVH): ratios 1, 2, 4


@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("specs", [MIXED_SPECS, DECODE_SPECS], ids=["mixed", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_reference(heads: tuple[int, int], block_size: int,
                                           specs: list[tuple[int, int]], dtype: torch.dtype) -> None:
    case = make_case(specs, *heads, head_dim=16, block_size=block_size, dtype=dtype, seed=block_size)
    ref = reference.paged_attention(*case.to(torch.float64).args())
    out = ops.paged_attention(*case.args(), **case.kwargs(), backend="torch")
    assert out.dtype == dtype and out.shape == case.query.shape
    assert rel_err(out, ref) < TOL[dtype]


def test_lists_optional() -> None:
    """Without the host-side length lists the backend reads them off the tensors."""
    case = make_case(MIXED_SPECS, 4, 2, head_dim=8, block_size=4)
    out = torch_native.paged_attention(*case.args())
    assert rel_err(out, reference.paged_attention(*case.to(torch.float64).args())) < 1e-5


def test_chunked_decode_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many decodes split across several gather chunks give the same answer."""
    monkeypatch.setattr(torch_native, "_CHUNK_BYTES", 1)  # one sequence per chunk
    case = make_case(DECODE_SPECS * 3, 6, 2, head_dim=8, block_size=4, seed=3)
    out = ops.paged_attention(*case.args(), **case.kwargs(), backend="torch")
    assert rel_err(out, reference.paged_attention(*case.to(torch.float64).args())) < 1e-5


# The C++ CPU backend's cache write too, where its extension can build (tests/kernels/test_cpu_kernels.py has the
# rest): a failed build there fails these cases instead of dropping them.
WRITE_BACKENDS = ["torch"] + (["cpu"] if cpu_ext_expected() else [])


@pytest.mark.parametrize("backend", WRITE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_kv_cache_matches_reference(dtype: torch.dtype, block_size: int, backend: str) -> None:
    key, value, kc, vc, slots = make_kv_write(11, 2, 8, block_size, num_blocks=12, dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    reference.write_kv_cache(key, value, kc_ref, vc_ref, slots)
    ops.write_kv_cache(key, value, kc, vc, slots, backend=backend)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_reference_backend_dispatch() -> None:
    case = make_case(DECODE_SPECS, 4, 2, head_dim=8, block_size=4)
    out = ops.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    assert torch.equal(out, reference.paged_attention(*case.args()))


def test_resolve_backend_cpu() -> None:
    # auto prefers the C++ kernel (test_cpu_kernels.py) where it builds
    assert ops.resolve_backend("auto", "cpu") == ("cpu" if "cpu" in ops.available_backends("cpu") else "torch")
    assert ops.resolve_backend("torch", "cpu") == "torch"
    assert {"reference", "torch"} <= set(ops.available_backends("cpu"))
    with pytest.raises(ValueError, match="unknown"):
        ops.resolve_backend("tensorrt", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="unavailable"):
            ops.resolve_backend("cuda", "cpu")


def test_triton_through_ops_on_cpu() -> None:
    """Under the interpreter the triton backend is available on CPU and dispatches to the kernels."""
    if "triton" not in ops.available_backends("cpu"):
        pytest.skip("triton not importable or not interpreting")
    case = make_case(MIXED_SPECS, 4, 2, head_dim=16, block_size=4)
    out = ops.paged_attention(*case.args(), **case.kwargs(), backend="triton")
    assert rel_err(out, reference.paged_attention(*case.to(torch.float64).args())) < 1e-4
