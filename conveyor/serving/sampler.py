"""Token sampling for one engine step.

Greedy, temperature, top-k, top-p, min-p and logprobs over a batch of logits rows. Seeded rows draw
with their own generator, one row at a time, so a seeded request's tokens do not depend on its batch
neighbours or its row position; everything else is vectorized across rows.

On CPU the sampled rows go to one C++ kernel (conveyor/kernels/csrc/cpu/sampling_cpu.cpp) when it is built: the same
distribution from the same one uniform per row, without torch's top-k, logsumexp and sort over the vocabulary
(a 64-row step over SmolLM2's 49k vocabulary: 7-26 ms in torch). Elsewhere, and without the kernel, torch.

A row whose logits have no finite maximum (a NaN anywhere, every token masked to -inf, a +inf) has no
distribution: it gets NO_TOKEN, never an id outside the vocabulary, and the scheduler ends that request with
finish reason "error"; the step's other rows are sampled as if it were not there. The kernel finds such rows
while it takes each row's maximum; the torch path checks the rows' maxima first. Logprobs are finite: -inf
(a token a grammar masks) is reported as LOGPROB_FLOOR, as vLLM's API clamps it.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from conveyor.kernels import cpu_ext
from conveyor.serving.outputs import SampledToken
from conveyor.serving.request import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator; it must live on the device the logits are on."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


# The token id of a row that has none to sample (see the module's docstring); the kernel's kNoToken.
NO_TOKEN = -1
# The smallest logprob reported: -inf is not JSON (vLLM's OpenAI server clamps to the same value).
LOGPROB_FLOOR = -9999.0

# Candidates per row for top-k/top-p: a top-k over them replaces a sort of the whole vocabulary (49k for SmolLM2:
# a sort of 64 rows took 170 ms on 2 cores, the top-k ~4 ms).
NUM_CANDIDATES = 256


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        # Unseeded rows share one generator per device; `seed` makes a whole run reproducible (tests).
        self._seed = seed
        self._default_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 logprob_logits: Tensor | None = None) -> list[SampledToken]:
        """sample() as one SampledToken per row."""
        token_ids, with_logprobs = self.sample(logits, params, generators, logprob_logits)
        return [with_logprobs.get(row) or SampledToken(token_id) for row, token_id in enumerate(token_ids)]

    def sample(self, logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
               logprob_logits: Tensor | None = None) -> tuple[list[int], dict[int, SampledToken]]:
        """Sample one token per row of `logits` [N, vocab]; params[i] and generators[i] belong to row i. Returns
        the token ids, and for the rows that ask for logprobs their SampledToken. Logprobs come from
        `logprob_logits` where given (the logits before penalties and bias, as vLLM's default raw logprobs are),
        else from `logits`."""
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logits rows, {len(params)} params, "
                             f"{len(generators)} generators")
        if not params:
            return [], {}
        logits = logits.float()
        # The kernel marks rows without a finite maximum itself; torch's ops would sample past the vocabulary.
        invalid = None if _uses_kernel(logits) else invalid_rows(logits)
        if invalid is not None:
            logits = logits.masked_fill(invalid.unsqueeze(1), 0.0)  # any finite row: its draw is discarded
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(sample_rows) == len(params):
            tokens = self._sample(logits, params, generators)
        else:
            # Greedy rows (and the all-greedy fast path) need only an argmax: no softmax, no sort.
            tokens = argmax(logits)
            if sample_rows:
                rows = torch.tensor(sample_rows, device=logits.device)
                tokens[rows] = self._sample(logits.index_select(0, rows),
                                            [params[i] for i in sample_rows],
                                            [generators[i] for i in sample_rows])
        if invalid is not None:
            tokens = tokens.masked_fill(invalid, NO_TOKEN)
        return _to_outputs(logits if logprob_logits is None else logprob_logits.float(), tokens, params)

    def default_generator(self, device: torch.device) -> torch.Generator:
        generator = self._default_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._default_generators[device] = generator
        return generator

    def _sample(self, logits: Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> Tensor:
        """Draw one token per row; every row here has temperature > 0. Never mutates `logits`."""
        device, vocab = logits.device, logits.shape[-1]
        if device.type == "cpu" and _cpu_kernel():
            # Through numpy: torch.tensor() of 256 rows' settings took ~0.5 ms a step, numpy's array ~0.1.
            settings = np.array([(p.temperature, p.top_p, p.min_p) for p in params], dtype=np.float32)
            temperature, top_p, min_p = torch.from_numpy(np.ascontiguousarray(settings.T))
            top_k = torch.from_numpy(np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                                              dtype=np.int64))
            return cpu_ext.sample_rows(logits, temperature, top_k, top_p, min_p,
                                       self._uniforms(len(params), generators, device))
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        scaled = logits / temps.unsqueeze(1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            scaled = _apply_min_p(scaled, min_p)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        filtered = [i for i, (k, p) in enumerate(zip(top_k, top_p, strict=True)) if k < vocab or p < 1.0]
        if not filtered:
            return self._inverse_cdf(torch.softmax(scaled, dim=-1), generators)
        tokens = torch.empty(len(params), dtype=torch.int64, device=device)
        if len(filtered) < len(params):
            filtered_set = set(filtered)
            plain = [i for i in range(len(params)) if i not in filtered_set]
            rows = torch.tensor(plain, device=device)
            tokens[rows] = self._inverse_cdf(torch.softmax(scaled.index_select(0, rows), dim=-1),
                                              [generators[i] for i in plain])
            scaled = scaled.index_select(0, torch.tensor(filtered, device=device))
        tokens[filtered] = self._sample_top_k_top_p(scaled, [top_k[i] for i in filtered],
                                                    [top_p[i] for i in filtered], [generators[i] for i in filtered])
        return tokens

    def _sample_top_k_top_p(self, scaled: Tensor, top_k: list[int], top_p: list[float],
                            generators: list[torch.Generator | None], num_candidates: int = NUM_CANDIDATES) -> Tensor:
        """Among a row's top candidates where they hold its whole filtered distribution (nearly always: a
        top-k within them, or a top-p reached inside their mass); the other rows try 16x the candidates, and
        past the vocabulary size a full sort. Exact either way."""
        device = scaled.device
        k = torch.tensor(top_k, device=device)
        p = torch.tensor(top_p, dtype=torch.float32, device=device)
        if 2 * num_candidates >= scaled.shape[-1]:  # a small vocabulary: its sort is as cheap as a top-k
            full = _apply_top_k_top_p(scaled, k, p)
            return self._inverse_cdf(torch.softmax(full, dim=-1), generators)
        cand_logits, cand_ids, exact = top_candidates(scaled, k, p, num_candidates)
        tokens = torch.empty(len(top_k), dtype=torch.int64, device=device)
        exact_rows = exact.nonzero().squeeze(1).tolist()
        if exact_rows:
            rows = torch.tensor(exact_rows, device=device)
            picked = self._inverse_cdf(torch.softmax(cand_logits.index_select(0, rows), dim=-1),
                                       [generators[i] for i in exact_rows])
            tokens[rows] = cand_ids.index_select(0, rows).gather(1, picked.unsqueeze(1)).squeeze(1)
        if len(exact_rows) < len(top_k):
            rest = (~exact).nonzero().squeeze(1).tolist()
            tokens[rest] = self._sample_top_k_top_p(
                scaled.index_select(0, torch.tensor(rest, device=device)), [top_k[i] for i in rest],
                [top_p[i] for i in rest], [generators[i] for i in rest], num_candidates * 16)
        return tokens

    def _uniforms(self, num_rows: int, generators: list[torch.Generator | None], device: torch.device) -> Tensor:
        """One uniform in [0, 1) per row. Unseeded rows share one draw; a seeded row draws its single number from
        its own generator, so its stream is the same whatever else is in the batch."""
        u = torch.empty(num_rows, dtype=torch.float32, device=device)
        seeded = [row for row, generator in enumerate(generators) if generator is not None]
        if len(seeded) < num_rows:
            u.uniform_(generator=self.default_generator(device))
        for row in seeded:
            u[row:row + 1].uniform_(generator=generators[row])
        return u

    def _inverse_cdf(self, probs: Tensor, generators: list[torch.Generator | None]) -> Tensor:
        """One uniform per row (_uniforms), located in the row's cumulative distribution: token i is picked with
        probability p_i, and it costs a cumsum rather than vocab random draws (5x cheaper on CPU)."""
        cdf = probs.cumsum_(dim=-1)
        u = self._uniforms(probs.shape[0], generators, probs.device).unsqueeze(1)
        # right=True picks i with cdf[i-1] <= u < cdf[i], so a zero-probability token (cdf[i] == cdf[i-1])
        # can never be chosen; scaling by a hair under the total keeps u below the last cdf value.
        u.mul_(cdf[:, -1:] * (1.0 - 1e-6))
        return torch.searchsorted(cdf, u, right=True).squeeze(1)


@functools.cache
def _cpu_kernel() -> bool:
    return cpu_ext.has_op("sample_rows")


def _uses_kernel(logits: Tensor) -> bool:
    """Whether both of the step's paths (argmax and sampling) run in the CPU kernel, which marks invalid rows."""
    return logits.device.type == "cpu" and logits.stride(-1) == 1 and _cpu_kernel()


def invalid_rows(logits: Tensor) -> Tensor | None:
    """A bool mask of the rows whose maximum is not finite (NaN, all -inf, +inf), or None when every row is
    fine (the common case; one reduction over the rows on the torch path). On an accelerator the mask is always
    returned: asking whether any row is bad would wait for the forward, masking costs the device microseconds."""
    invalid = ~torch.isfinite(logits.amax(dim=-1))
    if logits.device.type != "cpu":
        return invalid
    return invalid if bool(invalid.any()) else None


def argmax(logits: Tensor) -> Tensor:
    """torch.argmax over each row (the first maximum); the CPU kernel's is ~4x faster on a 49k vocabulary."""
    if logits.device.type == "cpu" and logits.stride(-1) == 1 and _cpu_kernel():
        return torch.ops.conveyor_cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)


def top_candidates(logits: Tensor, top_k: Tensor, top_p: Tensor,
                   num_candidates: int = NUM_CANDIDATES) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k then top-p applied to each row's num_candidates (or max k) largest logits, in descending order:
    (filtered logits with -inf for dropped candidates, their token ids, exact). exact[i]: the candidates hold
    row i's whole filtered distribution (its k fits among them, or without a k its top-p mass is reached
    within them), so sampling among them equals sampling from the fully sorted row."""
    vocab = logits.shape[-1]
    num = min(vocab, max(num_candidates, int(top_k[top_k < vocab].max()) if bool((top_k < vocab).any()) else 0))
    values, ids = logits.topk(num, dim=-1)
    ranks = torch.arange(num, device=logits.device)
    values = values.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    has_k = top_k <= num
    # Top-p works on the top-k-renormalized distribution: over the candidates when a k applies, else the row.
    normalizer = torch.where(has_k, values.logsumexp(-1), logits.logsumexp(-1))
    probs = (values - normalizer.unsqueeze(1)).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    exact = has_k | ((top_p < 1.0) & (probs.sum(-1) >= top_p))
    return values.masked_fill(drop, float("-inf")), ids, exact


def _apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p * (the row's top probability); min_p=0 drops none."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Top-k then top-p (on the top-k renormalized distribution) with one descending sort for all rows.

    Rows that disable a filter carry k = vocab / p = 1.0 and come out unchanged.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Keep the smallest prefix reaching top_p; the first token always survives (mass_before = 0).
    # Rows with top_p = 1 are excluded explicitly: cumsum rounding could otherwise clip their tail.
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    # A top_p that underflows to 0 in float32 would drop every token; the most likely one always stays.
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _to_outputs(logits: Tensor, tokens: Tensor, params: list[SamplingParams]
                ) -> tuple[list[int], dict[int, SampledToken]]:
    """The token ids, and the logprob rows' SampledTokens, with a single device->host transfer for the step."""
    lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not lp_rows:
        return tokens.tolist(), {}
    rows = torch.tensor(lp_rows, device=logits.device)
    # Logprobs come from the raw logits (before temperature and filters), as vLLM reports them; a grammar's masked
    # tokens are -inf there, and an invalid row's are NaN: both are reported as LOGPROB_FLOOR.
    logprobs = torch.log_softmax(logits.index_select(0, rows), dim=-1)
    chosen = logprobs.gather(1, tokens.index_select(0, rows).clamp(min=0).unsqueeze(1)).squeeze(1)
    top_n = max(params[i].logprobs or 0 for i in lp_rows)
    # float64 holds token ids exactly, so ids and logprobs travel together in one .tolist().
    parts = [tokens.double(), _finite(chosen)]
    if top_n:
        top_vals, top_ids = logprobs.topk(top_n, dim=-1)
        parts += [_finite(top_vals).flatten(), top_ids.double().flatten()]
    flat = torch.cat(parts).tolist()
    return _unpack(flat, len(params), lp_rows, params, top_n)


def _finite(logprobs: Tensor) -> Tensor:
    return torch.nan_to_num(logprobs.double(), nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)


def _unpack(flat: list[float], num_rows: int, lp_rows: list[int], params: list[SamplingParams],
            top_n: int) -> tuple[list[int], dict[int, SampledToken]]:
    token_ids = [int(t) for t in flat[:num_rows]]
    num_lp = len(lp_rows)
    chosen = flat[num_rows:num_rows + num_lp]
    vals_start = num_rows + num_lp
    ids_start = vals_start + num_lp * top_n
    with_logprobs = {}
    for j, row in enumerate(lp_rows):
        n = params[row].logprobs or 0
        base = j * top_n
        vals = flat[vals_start + base:vals_start + base + n]
        ids = flat[ids_start + base:ids_start + base + n]
        top = {int(i): v for i, v in zip(ids, vals, strict=True)}
        with_logprobs[row] = SampledToken(token_ids[row], chosen[j], top)
    return token_ids, with_logprobs
