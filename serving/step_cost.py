"""An online model of what a step costs, so the scheduler can size steps to an inter-token latency target.

Each step's time is fitted as  t = a + b * num_tokens + c * num_seqs  by exponentially weighted least squares
over the engine's own step timings: it follows the hardware (CPU, GPU, a busy neighbour) instead of a
hand-tuned batch size. No torch here: the scheduler uses it.
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
    _xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * 3)
    _coef: list[float] | None = None
    num_observations: int = 0

    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
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

    @property
    def ready(self) -> bool:
        return self._coef is not None

    def predict(self, num_tokens: int, num_seqs: int) -> float:
        if self._coef is None:
            raise RuntimeError("no fit yet")
        a, b, c = self._coef
        return a + b * num_tokens + c * num_seqs

    def max_tokens_within(self, target_s: float, num_seqs: int) -> int:
        """The most tokens a step over num_seqs sequences can carry and still be predicted under target_s."""
        a, b, c = self._coef or (0.0, 1.0, 0.0)
        return max(0, int((target_s - a - c * num_seqs) / b))
