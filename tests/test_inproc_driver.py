"""benchmarks/inproc.py run_inproc, the in-process load driver of `benchmarks.goodput --targets inproc`: with
max_concurrency it is a closed loop of that many clients (as run_load is over HTTP), without it every request goes
at its offset. A fake engine stands in for AsyncEngine: the test is of the driver alone."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from benchmarks.inproc import run_inproc
from conveyor.bench.workload import BenchRequest


class CountingEngine:
    """generate() yields two one-token steps, a few ms apart, and records how many requests were in flight."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0

    async def generate(self, prompt_token_ids: list[int], params: object):  # noqa: ANN201 - async generator
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for n in (1, 2):
                await asyncio.sleep(0.005)
                yield SimpleNamespace(delta_token_ids=[7], token_ids=[7] * n)
        finally:
            self.in_flight -= 1


@pytest.mark.parametrize(("max_concurrency", "expected"), [(3, 3), (None, 12)])
def test_max_concurrency_bounds_the_requests_in_flight(max_concurrency: int | None, expected: int) -> None:
    engine = CountingEngine()
    requests = [BenchRequest(prompt_token_ids=[1, 2, 3], max_tokens=2) for _ in range(12)]
    results, _ = asyncio.run(run_inproc(engine, requests, [0.0] * len(requests), max_concurrency))
    assert engine.max_in_flight == expected
    assert all(r.ok and r.output_tokens == 2 for r in results)
