"""An online model of what a step costs, so the scheduler can size steps to an inter-token latency target.

Each step's time is fitted as  t = a + b * num_tokens + c * num_seqs  by exponentially weighted least squares
over the engine's own step timings: it follows the hardware (CPU, GPU, a busy neighbour) instead of a
hand-tuned batch size. The fit predicts the mean; the SLO is on a tail, so the model also tracks an upper
quantile of actual/predicted (`margin`) and plans against prediction x margin: steps are noisier on a busy
host, and the margin grows with the noise instead of a fixed headroom guessing it. No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def _solve3(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Solve a 3x3 linear system by Gaussian elimination with partial pivoting; None if singular."""
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-18:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(3):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][3] / a[i][i] for i in range(3)]


@dataclass
class StepCostModel:
    # How fast old observations fade: ~1 / (1 - decay) steps of memory.
    decay: float = 0.98
    # Ridge strength: decode-only steps have num_tokens == num_seqs, which alone cannot separate b from c.
    ridge: float = 1e-3
    min_observations: int = 8
    # The quantile of actual/predicted step time planned against, and how fast that estimate moves.
    margin_quantile: float = 0.95
    margin_rate: float = 0.02
    margin: float = 1.0
    _xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * 3)
    _coef: list[float] | None = None
    num_observations: int = 0

    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        if self._coef is not None:
            self._update_margin(seconds / max(self.predict(num_tokens, num_seqs), 1e-9))
        x = (1.0, float(num_tokens), float(num_seqs))
        for i in range(3):
            self._xty[i] = self.decay * self._xty[i] + x[i] * seconds
            for j in range(3):
                self._xtx[i][j] = self.decay * self._xtx[i][j] + x[i] * x[j]
        self.num_observations += 1
        if self.num_observations >= self.min_observations:
            regularized = [[self._xtx[i][j] + (self.ridge if i == j and i > 0 else 0.0) for j in range(3)]
                           for i in range(3)]
            coef = _solve3(regularized, self._xty)
            if coef is not None:
                # A per-token or per-sequence cost can't be negative; clamp noise-driven fits.
                self._coef = [max(coef[0], 0.0), max(coef[1], 1e-7), max(coef[2], 0.0)]

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

    def predict(self, num_tokens: int, num_seqs: int) -> float:
        if self._coef is None:
            raise RuntimeError("no fit yet")
        a, b, c = self._coef
        return a + b * num_tokens + c * num_seqs

    def predict_tail(self, num_tokens: int, num_seqs: int) -> float:
        """The planning figure: the fitted mean scaled by the tracked upper quantile of the misfit."""
        return self.predict(num_tokens, num_seqs) * self.margin

    def max_tokens_within(self, target_s: float, num_seqs: int) -> int:
        """The most tokens a step over num_seqs sequences can carry with its tail prediction under target_s."""
        a, b, c = self._coef or (0.0, 1.0, 0.0)
        return max(0, int((target_s / self.margin - a - c * num_seqs) / b))
