"""The fused CPU norm and rope ops (conveyor/kernels/cpu_fused.py) against the torch code they replace."""
from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu_fused
from tests.cpu_ext_gate import require_cpu_ext

require_cpu_ext("rms_norm")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (33, 100), (0, 32)])
def test_rms_norm(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = torch.randn(shape[1], generator=gen).to(dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(cpu_fused.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", list(TOL))
def test_fused_add_rms_norm_updates_both_in_place(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(9, 576, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(576, generator=gen).to(dtype)
    expected_sum = x + residual
    expected = torch_rms_norm(expected_sum, weight, 1e-6)
    cpu_fused.fused_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, expected_sum, atol=0, rtol=0)
    torch.testing.assert_close(x, expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rope_on_strided_qkv_rows(dtype: torch.dtype, head_dim: int) -> None:
    """q|k heads rotated in place inside a fused qkv row; the v part is untouched."""
    num_tokens, q_heads, kv_heads = 5, 6, 2
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 17, 200, 1023])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    rotated = (q_heads + kv_heads) * head_dim
    expected = qkv.clone()
    heads = qkv[:, :rotated].view(num_tokens, q_heads + kv_heads, head_dim)
    expected[:, :rotated] = torch_rope(heads, cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)).flatten(1)
    cpu_fused.rotary_embedding_neox(qkv, cos, sin, q_heads + kv_heads, head_dim)
    torch.testing.assert_close(qkv, expected, atol=TOL[dtype] * 4, rtol=TOL[dtype])


def test_bad_inputs_raise() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_fused.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_fused.rms_norm(x, torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_fused.rms_norm(x.t(), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_fused.rotary_embedding_neox(x, torch.ones(4, 2), torch.ones(4, 2), 3, 4)
    with pytest.raises(RuntimeError, match="cos/sin"):
        cpu_fused.rotary_embedding_neox(x, torch.ones(4, 3), torch.ones(4, 3), 2, 4)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (64, 2 * 1536), (5, 2 * 37), (0, 8)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=gen) * 4).to(dtype)
    n = shape[1] // 2
    expected = (torch.nn.functional.silu(x[:, :n].float()) * x[:, n:].float()).to(dtype)  # one rounding
    out = cpu_fused.silu_and_mul(x)
    assert out.shape == (shape[0], n) and out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == torch.float32:  # the same vectorized exp as torch's silu: bitwise equal to what it replaces
        assert torch.equal(out, torch.nn.functional.silu(x[:, :n]) * x[:, n:])


def test_silu_and_mul_takes_strided_rows_and_refuses_odd_widths() -> None:
    wide = torch.randn(6, 40)
    x = wide[:, :32]  # rows strided by 40
    torch.testing.assert_close(cpu_fused.silu_and_mul(x), torch.nn.functional.silu(x[:, :16]) * x[:, 16:])
    with pytest.raises(RuntimeError, match="2 \\* n"):
        cpu_fused.silu_and_mul(torch.randn(3, 7))
