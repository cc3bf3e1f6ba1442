"""An online model of what a step costs, so the scheduler can size steps to an inter-token latency target.

Each step's time is fitted as  t = a + b * num_tokens + c * num_seqs + d * kv_reads / 1000  by exponentially
weighted least squares over the engine's own step timings, where kv_reads counts the key/value rows the step's
attention reads (each token over its causal prefix; SchedulerOutput.num_kv_reads): a 16-token chunk of a 2k-token
prompt reads ~32k rows, 16 times what one decode at that context reads, and costs accordingly. The fit follows the
hardware (CPU, GPU, a busy neighbour) instead of a hand-tuned batch size. It predicts the mean; the SLO is on a
tail, so the model also tracks an upper quantile of actual/predicted (`margin`) and plans against prediction x
margin: steps are noisier on a busy host, and the margin grows with the noise instead of a fixed headroom
guessing it. No torch here: the scheduler uses it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

NUM_FEATURES = 4
KV_SCALE = 1e-3  # kv_reads are thousands where tokens are tens: keep the normal equations well conditioned


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve a small linear system by Gaussian elimination with partial pivoting; None if singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-18:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


@dataclass
class StepCostModel:
    # How fast old observations fade: ~1 / (1 - decay) steps of memory.
    decay: float = 0.98
    # Ridge strength: decode-only steps have num_tokens == num_seqs, which alone cannot separate b from c.
    ridge: float = 1e-3
    min_observations: int = 8
    # The quantile of actual/predicted step time planned against, and how fast that estimate moves.
    margin_quantile: float = 0.99  # the SLO is on the p99
    margin_rate: float = 0.05
    margin: float = 1.0
    _xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES)
    _coef: list[float] | None = None
    num_observations: int = 0

    def observe(self, num_tokens: int, num_seqs: int, seconds: float, kv_reads: int = 0) -> None:
        if self._coef is not None:
            self._update_margin(seconds / max(self.predict(num_tokens, num_seqs, kv_reads), 1e-9))
        x = (1.0, float(num_tokens), float(num_seqs), kv_reads * KV_SCALE)
        for i in range(NUM_FEATURES):
            self._xty[i] = self.decay * self._xty[i] + x[i] * seconds
            for j in range(NUM_FEATURES):
                self._xtx[i][j] = self.decay * self._xtx[i][j] + x[i] * x[j]
        self.num_observations += 1
        if self.num_observations >= self.min_observations:
            regularized = [[self._xtx[i][j] + (self.ridge if i == j and i > 0 else 0.0)
                            for j in range(NUM_FEATURES)] for i in range(NUM_FEATURES)]
            coef = _solve(regularized, self._xty)
            if coef is not None:
                # No cost can be negative; clamp noise-driven fits (a per-token cost must stay positive).
                self._coef = [max(coef[0], 0.0), max(coef[1], 1e-7), max(coef[2], 0.0), max(coef[3], 0.0)]

    def _update_margin(self, ratio: float) -> None:
        # Stochastic-approximation quantile: in equilibrium a fraction margin_quantile of ratios fall below it.
        step = self.margin_rate * self.margin
        if ratio > self.margin:
            self.margin += step * self.margin_quantile
        else:
            self.margin -= step * (1.0 - self.margin_quantile)
        self.margin = min(max(self.margin, 1.0), 10.0)

    @property
    def ready(self) -> bool:
        return self._coef is not None

    def predict(self, num_tokens: int, num_seqs: int, kv_reads: int = 0) -> float:
        if self._coef is None:
            raise RuntimeError("no fit yet")
        a, b, c, d = self._coef
        return a + b * num_tokens + c * num_seqs + d * kv_reads * KV_SCALE

    def coefficients(self) -> tuple[float, float, float, float]:
        """(a, b, c, d) of the current fit: t = a + b * num_tokens + c * num_seqs + d * kv_reads * KV_SCALE."""
        if self._coef is None:
            raise RuntimeError("no fit yet")
        return tuple(self._coef)

    def predict_tail(self, num_tokens: int, num_seqs: int, kv_reads: int = 0) -> float:
        """The planning figure: the fitted mean scaled by the tracked upper quantile of the misfit."""
        return self.predict(num_tokens, num_seqs, kv_reads) * self.margin

    def max_tokens_within(self, target_s: float, num_seqs: int, num_decodes: int = 0, decode_kv_reads: int = 0,
                          prefill_context: int = 0, tail: bool = True) -> int:
        """The most tokens a step can carry with its tail prediction under target_s: num_decodes decodes reading
        decode_kv_reads rows, plus n prefill tokens of a prompt whose chunk starts at prefill_context (token k of
        the chunk reads prefill_context + k rows, so n of them read n * prefill_context + n (n + 1) / 2).
        Returns num_decodes + n. tail: plan against the tail prediction (predict_tail), else the mean."""
        a, b, c, d = self._coef or (0.0, 1.0, 0.0, 0.0)
        d *= KV_SCALE
        room = target_s / (self.margin if tail else 1.0) - (a + b * num_decodes + c * num_seqs + d * decode_kv_reads)
        if room <= 0:
            return num_decodes
        # Largest n with (d / 2) n^2 + (b + d (prefill_context + 1/2)) n <= room.
        linear = b + d * (prefill_context + 0.5)
        n = room / linear if d == 0 else (math.sqrt(linear * linear + 2 * d * room) - linear) / d
        return num_decodes + max(0, int(n))
