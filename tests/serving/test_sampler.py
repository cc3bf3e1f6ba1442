"""Sampler: greedy, filters, seeded batch invariance, distribution, logprobs."""
from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from conveyor.serving.request import SamplingParams
from conveyor.serving.sampler import Sampler, make_generator

VOCAB = 64


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """These tensors are tiny; intra-op threads only add wake-up latency (badly so on a busy CPU)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _random_logits(n: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def _logits_from_probs(probs: list[float], vocab: int = VOCAB) -> torch.Tensor:
    """One row whose softmax puts `probs` on tokens 0.. and spreads the remaining mass evenly."""
    rest = (1.0 - sum(probs)) / (vocab - len(probs))
    full = torch.tensor(probs + [rest] * (vocab - len(probs)), dtype=torch.float64)
    return full.log().float().unsqueeze(0)


def _ids(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
         generators: list[torch.Generator | None] | None = None) -> list[int]:
    return [s.token_id for s in sampler(logits, params, generators or [None] * len(params))]


def test_empty_batch() -> None:
    assert Sampler()(torch.empty(0, VOCAB), [], []) == []


def test_greedy_is_argmax() -> None:
    logits = _random_logits(16)
    got = _ids(Sampler(seed=0), logits, [SamplingParams(temperature=0.0)] * 16)
    assert got == logits.argmax(dim=-1).tolist()
    assert all(type(t) is int for t in got)


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = _random_logits(8)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(8)]
    got = _ids(Sampler(seed=0), logits, params)
    argmax = logits.argmax(dim=-1).tolist()
    assert [got[i] for i in range(1, 8, 2)] == [argmax[i] for i in range(1, 8, 2)]


@pytest.mark.parametrize("seeded", [False, True])
def test_top_k_1_equals_greedy(seeded: bool) -> None:
    logits = _random_logits(32)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 32
    gens = [make_generator(i) for i in range(32)] if seeded else None
    assert _ids(Sampler(seed=0), logits, params, gens) == logits.argmax(dim=-1).tolist()


def test_does_not_mutate_logits() -> None:
    logits = _random_logits(6)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, logprobs=3)] * 6
    Sampler(seed=0)(logits, params, [None, make_generator(1)] * 3)
    assert torch.equal(logits, before)


def _run_seeded(row_logits: list[torch.Tensor], params: SamplingParams, seed: int, position: int,
                neighbours: int) -> list[int]:
    """Sample `len(row_logits)` steps for one seeded request placed at `position` among neighbours."""
    sampler = Sampler(seed=123)
    gen = make_generator(seed)
    other_gen = make_generator(999)
    # Neighbours exercise every other code path: greedy, unseeded, seeded, sorted filters.
    neighbour_params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3),
                        SamplingParams(temperature=0.8, top_p=0.5), SamplingParams(min_p=0.2, seed=5)]
    out = []
    for step, row in enumerate(row_logits):
        others = _random_logits(neighbours, seed=1000 + step)
        batch = list(others)
        batch.insert(position, row)
        plist = [neighbour_params[i % 4] for i in range(neighbours)]
        plist.insert(position, params)
        gens: list[torch.Generator | None] = [other_gen if p.seed is not None else None for p in plist]
        gens[position] = gen
        out.append(_ids(sampler, torch.stack(batch), plist, gens)[position])
    return out


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=7),
                                    SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05, seed=7)])
def test_seeded_is_independent_of_batch_and_position(params: SamplingParams) -> None:
    rows = list(_random_logits(16, seed=42) * 0.3)  # flat-ish, so draws are genuinely random
    alone = _run_seeded(rows, params, seed=7, position=0, neighbours=0)
    assert _run_seeded(rows, params, seed=7, position=0, neighbours=5) == alone
    assert _run_seeded(rows, params, seed=7, position=3, neighbours=5) == alone
    assert _run_seeded(rows, params, seed=7, position=7, neighbours=7) == alone
    assert len(set(alone)) > 5


def test_different_seeds_differ() -> None:
    rows = list(_random_logits(16, seed=42) * 0.3)
    params = SamplingParams(temperature=1.0)
    a = _run_seeded(rows, params, seed=1, position=0, neighbours=2)
    b = _run_seeded(rows, params, seed=2, position=0, neighbours=2)
    assert a != b


def _sample_many(params: SamplingParams, row: torch.Tensor, n: int = 4000, seed: int = 0) -> list[int]:
    return _ids(Sampler(seed=seed), row.expand(n, -1).contiguous(), [params] * n)


def test_top_k_never_picks_excluded() -> None:
    row = _logits_from_probs([0.3, 0.2, 0.1, 0.05])
    assert set(_sample_many(SamplingParams(top_k=3), row)) == {0, 1, 2}


@pytest.mark.parametrize(("top_p", "allowed"), [(0.45, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2})])
def test_top_p_never_picks_excluded(top_p: float, allowed: set[int]) -> None:
    row = _logits_from_probs([0.5, 0.3, 0.1])  # the other 61 tokens share 0.1
    assert set(_sample_many(SamplingParams(top_p=top_p), row)) == allowed


@pytest.mark.parametrize(("min_p", "allowed"), [(0.7, {0}), (0.5, {0, 1}), (0.15, {0, 1, 2})])
def test_min_p_never_picks_excluded(min_p: float, allowed: set[int]) -> None:
    row = _logits_from_probs([0.5, 0.3, 0.1])  # each other token has 0.1 / 61 < 0.15 * 0.5
    assert set(_sample_many(SamplingParams(min_p=min_p), row)) == allowed


def test_per_row_filters_in_one_batch() -> None:
    """Vectorized filters must apply each row's own setting, including rows with none."""
    row = _logits_from_probs([0.5, 0.3, 0.1])
    kinds = [SamplingParams(top_k=1), SamplingParams(top_p=0.7), SamplingParams(min_p=0.15),
             SamplingParams(top_k=2, seed=3), SamplingParams()]
    params = kinds * 600
    gens = [make_generator(i) if p.seed is not None else None for i, p in enumerate(params)]
    got = _ids(Sampler(seed=0), row.expand(len(params), -1).contiguous(), params, gens)
    by_kind = [set(got[i::len(kinds)]) for i in range(len(kinds))]
    assert by_kind[0] == {0}
    assert by_kind[1] == {0, 1}
    assert by_kind[2] == {0, 1, 2}
    assert by_kind[3] == {0, 1}
    assert len(by_kind[4] - {0, 1, 2}) > 0  # the unfiltered row reaches the tail


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# Critical value of chi-square with 7 degrees of freedom at p = 0.001; the draws are seeded, so the
# test is deterministic, and a wrong distribution (e.g. temperature ignored) scores in the hundreds.
_CHI2_DF7_P001 = 24.32


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_distribution_matches_softmax_unseeded(temperature: float) -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5]])
    n = 20000
    got = torch.tensor(_sample_many(SamplingParams(temperature=temperature), logits, n=n))
    counts = torch.bincount(got, minlength=8).double()
    probs = torch.softmax(logits[0].double() / temperature, dim=-1)
    assert _chi_square(counts, probs) < _CHI2_DF7_P001


def test_distribution_matches_softmax_seeded_row() -> None:
    """The per-row (seeded) draw path is an exact sampler too."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5]])
    sampler, gen = Sampler(), make_generator(11)
    params = [SamplingParams(seed=11)]
    draws = [_ids(sampler, logits, params, [gen])[0] for _ in range(3000)]
    counts = torch.bincount(torch.tensor(draws), minlength=8).double()
    assert _chi_square(counts, torch.softmax(logits[0].double(), dim=-1)) < _CHI2_DF7_P001


def test_logprobs_are_raw_log_softmax() -> None:
    logits = _random_logits(4)
    params = [SamplingParams(temperature=0.7, top_k=5, logprobs=3),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.3, top_p=0.5, logprobs=5)]
    out = Sampler(seed=0)(logits, params, [None, None, None, make_generator(4)])
    ref = torch.log_softmax(logits.double(), dim=-1)

    for row in (0, 1, 3):
        tok = out[row]
        assert type(tok.logprob) is float
        assert math.isclose(tok.logprob, float(ref[row, tok.token_id]), abs_tol=1e-5)
        n = params[row].logprobs
        assert tok.top_logprobs is not None and len(tok.top_logprobs) == n
        top_vals, top_ids = ref[row].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert list(tok.top_logprobs) == top_ids.tolist()
        for tid, lp in tok.top_logprobs.items():
            assert type(tid) is int and math.isclose(lp, float(ref[row, tid]), abs_tol=1e-5)
    assert out[1].top_logprobs == {}
    assert out[2].logprob is None and out[2].top_logprobs is None


def test_make_generator_is_reproducible() -> None:
    a = torch.rand(5, generator=make_generator(3))
    b = torch.rand(5, generator=make_generator(3))
    assert torch.equal(a, b)
    assert make_generator(3, "cpu").device == torch.device("cpu")


def test_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, VOCAB), [SamplingParams()], [None])


def test_underflowing_temperature_and_top_p_still_pick_a_real_token():
    from conveyor.serving.sampler import Sampler

    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=1e-300), SamplingParams(top_p=5e-324)]
    tokens = [t.token_id for t in Sampler(seed=0)(logits, params, [None, None])]
    assert tokens == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_k,top_p", [(20, 1.0), (0, 0.9), (300, 0.5), (0, 0.999), (5, 0.3)])
def test_top_candidates_keep_what_a_full_sort_keeps(top_k: int, top_p: float) -> None:
    """Filtering among a row's top candidates keeps the same tokens with the same probabilities as the full sort,
    on every row it calls exact; peaked rows (as a trained model's) are exact."""
    from conveyor.serving.sampler import _apply_top_k_top_p, top_candidates

    gen = torch.Generator().manual_seed(top_k)
    vocab = 5000
    logits = torch.randn(12, vocab, generator=gen) * torch.linspace(1, 12, 12).unsqueeze(1)
    k = torch.full((12,), top_k if top_k else vocab)
    p = torch.full((12,), top_p)
    cand_logits, cand_ids, exact = top_candidates(logits, k, p)
    assert bool(exact[6:].all())  # the peaked half
    full = torch.softmax(_apply_top_k_top_p(logits, k, p), dim=-1)
    mine = torch.zeros_like(full).scatter_(1, cand_ids, torch.softmax(cand_logits, dim=-1))
    torch.testing.assert_close(mine[exact], full[exact], atol=1e-6, rtol=1e-5)
