"""The CPU sampling kernel (csrc/cpu/sampling_cpu.cpp) against a float64 inverse-CDF reference.

For a given uniform u the kernel must pick exactly the token the reference picks: with a top-k, the u-quantile of
the kept tokens in descending order of probability; otherwise (no filter, or top-p alone, whose nucleus is found
without a sort) the u-quantile of the kept tokens in vocabulary order. Every filter
(temperature, min_p, top-k, top-p on the top-k renormalized distribution) and the candidate search (a threshold
below the row's max that drops until the candidates hold the answer) are exercised on a 49k vocabulary with
peaked, flat, tied and partly masked rows.
"""
from __future__ import annotations

import math

import pytest
import torch

from conveyor.kernels import cpu_ext

if not cpu_ext.has_op("sample_rows"):
    pytest.skip("CPU extension cannot be built here", allow_module_level=True)

VOCAB = 49152


def reference_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                    u: float) -> int:
    """The token an exact sampler picks at quantile u (float64)."""
    s = logits.double() / temperature
    probs = torch.softmax(s, dim=-1)
    keep = probs >= min_p * probs.max()
    s = s.masked_fill(~keep, -math.inf)
    vocab = s.shape[0]
    if top_k >= vocab and top_p >= 1.0:
        p = torch.softmax(s, dim=-1)
        cdf = p.cumsum(0)
        return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    order = s.argsort(descending=True, stable=True)
    ranked = s[order]
    if top_k < vocab:
        ranked[top_k:] = -math.inf
    p = torch.softmax(ranked, dim=-1)  # over the top-k (or every kept token)
    if top_p < 1.0:
        before = p.cumsum(0) - p
        drop = before >= top_p
        drop[0] = False
        p = p.masked_fill(drop, 0.0)
    if top_k >= vocab:  # top-p alone: the nucleus in vocabulary order
        p = torch.zeros(vocab, dtype=torch.float64).index_put_((order,), p)
        order = torch.arange(vocab)
    cdf = p.cumsum(0)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    return int(order[min(index, vocab - 1)])


def _rows(kind: str, num: int, gen: torch.Generator) -> torch.Tensor:
    base = torch.randn(num, VOCAB, generator=gen)
    if kind == "peaked":  # an LM's usual shape: a few tokens far above a long tail
        base[:, :40] += torch.linspace(12, 4, 40)
        return base[:, torch.randperm(VOCAB, generator=gen)]
    if kind == "flat":  # high entropy: top-p needs thousands of tokens
        return base * 0.5
    if kind == "ties":  # a handful of distinct values: the nucleus ends inside a run of equal logits
        return torch.randint(0, 6, (num, VOCAB), generator=gen).float() * 0.7
    if kind == "masked":  # a grammar's bitmask: most tokens -inf
        masked = base * 2
        masked[:, torch.rand(VOCAB, generator=gen) < 0.97] = -math.inf
        return masked
    raise ValueError(kind)


CASES = [  # temperature, top_k, top_p, min_p
    (1.0, VOCAB, 1.0, 0.0), (0.7, VOCAB, 0.9, 0.0), (1.3, 50, 1.0, 0.0), (0.8, 40, 0.95, 0.0),
    (1.0, VOCAB, 1.0, 0.05), (0.9, VOCAB, 0.5, 0.1), (1.0, 5000, 0.99, 0.0), (2.0, VOCAB, 0.999, 0.0),
    (1.0, 1, 1.0, 0.0), (0.5, VOCAB, 0.0, 0.0),
]


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_picks_the_reference_token(kind: str, threads: int) -> None:
    gen = torch.Generator().manual_seed(len(kind) + threads)
    logits = _rows(kind, len(CASES) * 3, gen)
    params = [CASES[i % len(CASES)] for i in range(logits.shape[0])]
    u = torch.rand(logits.shape[0], generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_ext.sample_rows(logits, torch.tensor([c[0] for c in params]), torch.tensor([c[1] for c in params]),
                                  torch.tensor([c[2] for c in params]), torch.tensor([c[3] for c in params]), u)
    finally:
        torch.set_num_threads(before)
    want = [reference_token(logits[i], *params[i], float(u[i])) for i in range(logits.shape[0])]
    assert got.dtype == torch.int64
    # Float32 sums against float64 ones may move a quantile that lands within ~1e-6 of a boundary: allow one.
    mismatches = [(i, params[i], int(got[i]), want[i]) for i in range(len(want)) if int(got[i]) != want[i]]
    assert len(mismatches) <= 1, mismatches
    assert all(torch.isfinite(logits[i, int(got[i])]) for i in range(len(want)))  # never a masked token


def test_extreme_parameters_pick_real_tokens() -> None:
    logits = torch.randn(3, VOCAB)
    logits[:, 7] = -math.inf
    tokens = cpu_ext.sample_rows(logits, torch.tensor([0.0, 1e-30, 1.0]), torch.tensor([VOCAB, VOCAB, VOCAB]),
                                 torch.tensor([1.0, 1.0, 0.0]), torch.zeros(3), torch.tensor([0.5, 0.999, 0.3]))
    assert tokens.tolist() == logits.argmax(-1).tolist()  # temperature 0 / underflowing: argmax; top_p 0: top token


def test_bad_inputs_raise() -> None:
    logits = torch.randn(2, 100)
    ok = dict(temperature=torch.ones(2), top_k=torch.full((2,), 100), top_p=torch.ones(2), min_p=torch.zeros(2),
              uniforms=torch.rand(2))
    with pytest.raises(RuntimeError, match="float32 CPU"):
        torch.ops.conveyor_cpu.sample_rows(logits.double(), *ok.values())
    with pytest.raises(RuntimeError, match="temperature must be >= 0"):
        torch.ops.conveyor_cpu.sample_rows(logits, -torch.ones(2), *list(ok.values())[1:])
    with pytest.raises(RuntimeError, match="top_k"):
        torch.ops.conveyor_cpu.sample_rows(logits, ok["temperature"], torch.zeros(2, dtype=torch.long),
                                           *list(ok.values())[2:])


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152])
def test_argmax_rows_equals_torch_argmax(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen)
    logits[1] = 0.0  # ties: the first maximum, as torch
    logits[2, vocab // 2:] = logits[2].max()
    logits[3, :-1] = -math.inf
    assert torch.equal(torch.ops.conveyor_cpu.argmax_rows(logits), logits.argmax(dim=-1))
    strided = torch.randn(4, 2 * vocab, generator=gen)[:, :vocab]  # rows of a wider buffer
    assert torch.equal(torch.ops.conveyor_cpu.argmax_rows(strided), strided.argmax(dim=-1))
