"""The GGUF-block linear (conveyor/kernels/gguf.py) against its torch reference: dequantize, then an fp32 matmul."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conveyor.kernels import gguf
from tests.cpu_ext_gate import require_cpu_ext
from tests.tiny_model import quantize

require_cpu_ext("gguf_linear")

TYPES = [gguf.Q4_1, gguf.Q8_0]


def random_blocks(num_rows: int, in_features: int, ggml_type: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(num_rows, in_features, generator=gen), ggml_type)


@pytest.mark.parametrize("ggml_type", TYPES, ids=gguf.TYPE_NAMES.get)
def test_dequantize_matches_the_gguf_library(ggml_type: int) -> None:
    from gguf import GGMLQuantizationType, dequantize

    blocks = random_blocks(7, 96, ggml_type)
    expected = dequantize(blocks.numpy(), GGMLQuantizationType(ggml_type)).astype(np.float32)
    assert torch.equal(gguf.dequantize(blocks, ggml_type, 96), torch.from_numpy(expected))


@pytest.mark.parametrize("ggml_type", TYPES, ids=gguf.TYPE_NAMES.get)
def test_quantize_round_trips_within_half_a_step(ggml_type: int) -> None:
    w = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    back = gguf.dequantize(quantize(w, ggml_type), ggml_type, 64)
    step = (w.amax() - w.amin()) / (15 if ggml_type == gguf.Q4_1 else 254)
    assert (back - w).abs().max() <= step  # half a step of rounding plus the fp16 scale's error


@pytest.mark.parametrize("ggml_type", TYPES, ids=gguf.TYPE_NAMES.get)
@pytest.mark.parametrize("shape", [(1, 32), (33, 64), (96, 576), (17, 1536)], ids=str)
def test_prepared_layout_holds_the_same_weights(ggml_type: int, shape: tuple[int, int]) -> None:
    out_features, in_features = shape
    blocks = random_blocks(out_features, in_features, ggml_type)
    prepared = gguf.prepare(blocks, ggml_type, in_features)
    assert prepared.in_features == in_features and prepared.out_features == out_features
    assert torch.equal(prepared.dequantize(), gguf.dequantize(blocks, ggml_type, in_features))


@pytest.mark.parametrize("ggml_type", TYPES, ids=gguf.TYPE_NAMES.get)
@pytest.mark.parametrize("num_rows", [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 40])
@pytest.mark.parametrize("shape", [(1, 32), (33, 64), (96, 576), (40, 1536)], ids=str)
def test_linear_matches_dequantized_matmul(ggml_type: int, num_rows: int, shape: tuple[int, int]) -> None:
    out_features, in_features = shape
    blocks = random_blocks(out_features, in_features, ggml_type, seed=num_rows)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(1))
    expected = x @ gguf.dequantize(blocks, ggml_type, in_features).T
    out = gguf.gguf_linear(x, gguf.prepare(blocks, ggml_type, in_features))
    torch.testing.assert_close(out, expected, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 3])
def test_linear_is_the_same_on_any_thread_count(num_threads: int) -> None:
    blocks = random_blocks(200, 576, gguf.Q4_1)
    weight = gguf.prepare(blocks, gguf.Q4_1, 576)
    x = torch.randn(12, 576, generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gguf.gguf_linear(x, weight)
        torch.set_num_threads(num_threads)
        assert torch.equal(gguf.gguf_linear(x, weight), one)  # each output has one fixed summation order
    finally:
        torch.set_num_threads(before)


def test_linear_takes_strided_and_batched_inputs() -> None:
    blocks = random_blocks(40, 64, gguf.Q4_1)
    wide = torch.randn(3, 2, 128)
    x = wide[..., ::2]  # [3, 2, 64], not contiguous
    expected = x.reshape(6, 64) @ gguf.dequantize(blocks, gguf.Q4_1, 64).T
    out = gguf.gguf_linear(x, gguf.prepare(blocks, gguf.Q4_1, 64))
    assert out.shape == (3, 2, 40)
    torch.testing.assert_close(out.reshape(6, 40), expected, atol=1e-4, rtol=1e-5)


def test_bad_inputs_raise() -> None:
    blocks = random_blocks(8, 64, gguf.Q4_1)
    weight = gguf.prepare(blocks, gguf.Q4_1, 64)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        torch.ops.conveyor_cpu.gguf_prepare(blocks, 2, 64)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        torch.ops.conveyor_cpu.gguf_linear_rows(torch.randn(1, 64), blocks, 2, 8)
    with pytest.raises(RuntimeError, match="expected"):
        torch.ops.conveyor_cpu.gguf_prepare(blocks, gguf.Q8_0, 64)  # Q4_1 rows read as Q8_0
    with pytest.raises(RuntimeError, match="multiple of 32"):
        gguf.gguf_linear(torch.randn(1, 48), weight)
    with pytest.raises(RuntimeError, match="expected"):
        gguf.gguf_linear(torch.randn(1, 96), weight)  # K differs from the weight's
    with pytest.raises(RuntimeError, match="float32"):
        gguf.gguf_linear(torch.randn(1, 64, dtype=torch.float64), weight)
    with pytest.raises(ValueError, match="unsupported ggml type"):
        gguf.row_bytes(2, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        gguf.prepare(blocks, gguf.Q4_1, 48)


@pytest.mark.parametrize("ggml_type", TYPES, ids=gguf.TYPE_NAMES.get)
def test_both_kernels_compute_the_same_linear(ggml_type: int) -> None:
    """gguf_linear splits steps by rows between the GGUF-rows and the interleaved kernel: each must be right at
    every row count, not only on its side of the split."""
    blocks = random_blocks(72, 576, ggml_type)
    weight = gguf.prepare(blocks, ggml_type, 576)
    expected_w = gguf.dequantize(blocks, ggml_type, 576)
    for num_rows in (1, 3, 7, 12, 13):
        x = torch.randn(num_rows, 576, generator=torch.Generator().manual_seed(num_rows))
        rows = torch.ops.conveyor_cpu.gguf_linear_rows(x, blocks, ggml_type, 72)
        groups = torch.ops.conveyor_cpu.gguf_linear(x, weight.q, weight.scales, ggml_type, 72)
        torch.testing.assert_close(rows, x @ expected_w.T, atol=2e-4, rtol=1e-5)
        torch.testing.assert_close(groups, x @ expected_w.T, atol=2e-4, rtol=1e-5)


bf16_kernel = pytest.mark.skipif(not gguf.has_bf16_kernel(), reason="no AVX512-BF16: no bf16 blocks kernel here")


@bf16_kernel
@pytest.mark.parametrize("ggml_type", TYPES, ids=gguf.TYPE_NAMES.get)
@pytest.mark.parametrize("num_rows", [0, 1, 2, 7, 8, 12, 13, 25, 40])
@pytest.mark.parametrize("shape", [(1, 32), (33, 64), (96, 576), (40, 1536)], ids=str)
def test_bf16_kernel_matches_the_matmul_of_rounded_operands(ggml_type: int, num_rows: int,
                                                            shape: tuple[int, int]) -> None:
    """Weights and activations rounded to bf16 (nearest even), products summed in fp32: the packed bf16 GEMM's
    numbers, so only the summation order differs."""
    out_features, in_features = shape
    blocks = random_blocks(out_features, in_features, ggml_type, seed=num_rows)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(2))
    weight = gguf.dequantize(blocks, ggml_type, in_features)
    expected = x.bfloat16().float() @ weight.bfloat16().float().T
    out = gguf.gguf_linear(x, gguf.prepare(blocks, ggml_type, in_features), bf16_min_rows=1)
    if num_rows > gguf.ROWS_KERNEL_MAX_ROWS[ggml_type]:  # the smallest steps keep the fp32 rows kernel
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
        if num_rows:
            assert not torch.allclose(out, x @ weight.T, atol=1e-5, rtol=0)  # really rounded
    else:
        torch.testing.assert_close(out, x @ weight.T, atol=2e-4, rtol=1e-5)


@bf16_kernel
def test_bf16_kernel_rejects_a_layout_it_was_not_prepared_for() -> None:
    prepared = gguf.prepare(random_blocks(40, 64, gguf.Q4_1), gguf.Q4_1, 64)
    with pytest.raises(RuntimeError, match="expected"):
        torch.ops.conveyor_cpu.gguf_linear_bf16(torch.randn(9, 96), prepared.q, prepared.scales, gguf.Q4_1, 40)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        torch.ops.conveyor_cpu.gguf_linear_bf16(torch.randn(9, 64), prepared.q, prepared.scales, 2, 40)


int8_kernel = pytest.mark.skipif(not gguf.has_int8_kernel(), reason="no AVX512-VNNI nor AVX2: no int8 kernel here")


@int8_kernel
@pytest.mark.parametrize("ggml_type", TYPES, ids=gguf.TYPE_NAMES.get)
@pytest.mark.parametrize("num_rows", [0, 1, 5, 6, 7, 13, 48, 49, 100])
@pytest.mark.parametrize("shape", [(1, 32), (33, 64), (96, 576), (40, 1536)], ids=str)
def test_int8_kernel_matches_the_matmul_of_int8_rounded_activations(ggml_type: int, num_rows: int,
                                                                    shape: tuple[int, int]) -> None:
    """Each block of 32 activations rounded to int8 at its own scale, times the dequantized weight: only the
    summation order differs (tiles of 6 rows (AVX2: 3), sweeps of 48, a last pass of padded features all covered)."""
    out_features, in_features = shape
    blocks = random_blocks(out_features, in_features, ggml_type, seed=num_rows)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(4))
    x[:, :32] *= torch.linspace(3, 0, num_rows).unsqueeze(1)  # blocks of other scales, the last row's zero
    weight = gguf.dequantize(blocks, ggml_type, in_features)
    int8_weight = gguf.prepare_int8(gguf.prepare(blocks, ggml_type, in_features))
    out = gguf.gguf_linear_int8(x, int8_weight)
    expected = gguf.int8_linear_reference(x, weight)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    if num_rows:
        assert not torch.allclose(out, x @ weight.T, atol=1e-4, rtol=0)  # really rounded


@int8_kernel
@pytest.mark.parametrize("ggml_type", TYPES, ids=gguf.TYPE_NAMES.get)
def test_int8_kernel_sums_the_largest_products_without_saturating(ggml_type: int) -> None:
    """Every quant at its extreme times every activation at +-127: the AVX2 kernel's int16 pair sums would
    saturate for Q8_0 (2 * 255 * 127 > 32767) without its sign trick, and a Q4_1 block's sums come nearest 32767."""
    in_features = 256
    weight = torch.ones(32, in_features)
    weight[1::2] = -1.0  # Q8_0: q = +-127 (u = 255, 1)
    weight[::4, ::2] = 0.0  # Q4_1: u = 0 and 15 side by side
    blocks = quantize(weight, ggml_type)
    int8_weight = gguf.prepare_int8(gguf.prepare(blocks, ggml_type, in_features))
    x = torch.ones(4, in_features)
    x[1] = -1.0
    x[2, 1::2] = -1.0
    out = gguf.gguf_linear_int8(x, int8_weight)
    expected = gguf.int8_linear_reference(x, gguf.dequantize(blocks, ggml_type, in_features))
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


def test_int8_rounding_keeps_each_block_on_its_own_grid() -> None:
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(5))
    x[1, 32:64] = 0
    x[2, :32] *= 1000
    rounded = gguf.round_activations_int8(x)
    blocks, source = rounded.reshape(3, 3, 32), x.reshape(3, 3, 32)
    step = source.abs().amax(-1, keepdim=True) / 127
    quants = blocks / torch.where(step > 0, step, torch.ones_like(step))
    torch.testing.assert_close(quants, quants.round(), atol=1e-3, rtol=0)
    assert quants.abs().max() <= 127 and torch.equal(blocks[1, 1], torch.zeros(32))
    assert ((blocks - source).abs() <= step / 2 * 1.0001).all()  # half a step at most
    torch.testing.assert_close(rounded[2, 32:], x[2, 32:], atol=0.02, rtol=0)  # a loud block leaves the others alone


@int8_kernel
def test_int8_kernel_rejects_a_layout_it_was_not_prepared_for() -> None:
    int8_weight = gguf.prepare_int8(gguf.prepare(random_blocks(40, 64, gguf.Q4_1), gguf.Q4_1, 64))
    with pytest.raises(RuntimeError, match="expected"):
        torch.ops.conveyor_cpu.gguf_linear_int8(torch.randn(9, 96), int8_weight.u, int8_weight.dm, gguf.Q4_1, 40)
    with pytest.raises(RuntimeError, match="expected"):
        torch.ops.conveyor_cpu.gguf_linear_int8(torch.randn(9, 64), int8_weight.u, int8_weight.dm, gguf.Q4_1, 80)
