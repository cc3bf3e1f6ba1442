"""The grammar bitmask kernel against its torch reference, and the reference against the bits one by one."""
from __future__ import annotations

import pytest
import torch

from conveyor.kernels import token_bitmask


def random_bitmask(num_rows: int, num_words: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_rows, num_words), dtype=torch.int32, generator=gen)
    # Grammar masks are mostly whole words: all allowed (free text) or none (JSON structure).
    kind = torch.randint(0, 3, (num_rows, num_words), generator=gen)
    bitmask[kind == 0] = -1
    bitmask[kind == 1] = 0
    return bitmask


def test_reference_matches_the_bits_one_by_one() -> None:
    bitmask = random_bitmask(3, 4, seed=0)
    allowed = token_bitmask.unpack(bitmask, 4 * 32 + 5)
    for row in range(3):
        for token in range(4 * 32):
            word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
            assert bool(allowed[row, token]) == bool(word >> (token % 32) & 1)
    assert not allowed[:, 128:].any()


@pytest.mark.skipif(not token_bitmask.kernel_available(), reason="CPU extension not built")
@pytest.mark.parametrize("vocab, num_words", [(32, 1), (100, 4), (49152, 1536), (130, 4), (1000, 20)])
@pytest.mark.parametrize("rows", [[0], [2, 0], [1, 3, 4, 2]])
def test_kernel_matches_reference(vocab: int, num_words: int, rows: list[int]) -> None:
    """vocab < 32 W: a mask wider than the logits; vocab > 32 W (1000 vs 640): padded logits beyond the mask."""
    gen = torch.Generator().manual_seed(vocab + len(rows))
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = random_bitmask(len(rows), num_words, seed=vocab)
    index = torch.tensor(rows, dtype=torch.int64)
    expected, got = logits.clone(), logits.clone()
    token_bitmask.apply_reference(expected, bitmask, index)
    torch.ops.conveyor_cpu.apply_token_bitmask(got, bitmask, index)
    assert torch.equal(got, expected)
    untouched = [r for r in range(5) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])


@pytest.mark.skipif(not token_bitmask.kernel_available(), reason="CPU extension not built")
def test_kernel_refuses_bad_shapes() -> None:
    logits = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="one bitmask row"):
        torch.ops.conveyor_cpu.apply_token_bitmask(logits, torch.zeros(3, 2, dtype=torch.int32),
                                                   torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.conveyor_cpu.apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([7]))
