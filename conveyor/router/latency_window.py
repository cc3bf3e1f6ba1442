"""Samples over a sliding time window: the replica's TTFT and inter-token p99, and its share of requests refused,
for the autoscaling policy."""
from __future__ import annotations

import time
from collections import deque


class LatencyWindow:
    """Samples of one latency over the last `window_s` seconds (bounded), for percentiles on demand."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 10_000) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, value: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, value))

    def percentile(self, q: float, now: float | None = None) -> float:
        values = sorted(self._values(now))
        return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0

    def mean(self, now: float | None = None) -> float:
        values = self._values(now)
        return sum(values) / len(values) if values else 0.0

    def _values(self, now: float | None) -> list[float]:
        cutoff = (time.monotonic() if now is None else now) - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        return [v for _, v in self._samples]
