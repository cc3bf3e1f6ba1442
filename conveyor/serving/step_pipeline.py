"""Async scheduling (vLLM's `--async-scheduling`): the model runs step N on a worker thread while the engine's
thread schedules step N+1 and turns step N-1's tokens into outputs.

The engine keeps at most two steps in flight: the one running and the one queued behind it, so the runner never
waits for the host between steps. What that costs, and how it stays correct:
- The scheduler counts a step's tokens as computed when it schedules them and leaves a placeholder for each token
  to be sampled (scheduler.py); the runner feeds a decode whose input token is not yet appended from its own
  record of what it sampled last (input_batch.chunk_token_ids).
- A request that ends at EOS or a stop token is known to have ended one step late: the step scheduled meanwhile
  computes one token for it, which is dropped. Length limits are known ahead, so nothing is scheduled past them.
- Sampling that reads the request's own output (penalties, min_tokens, grammars) needs the token in flight: while
  such a request has one, the engine waits for that step before scheduling the next (engine.py).
- A request preempted by the step scheduled meanwhile still gets the token in flight; it recomputes with it.

The worker thread releases the GIL inside torch, so the engine's thread runs between the kernels of the forward.
On a GPU that is where the host's work hides; on a CPU whose every core runs the forward's thread team it
competes with it (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from conveyor.serving.outputs import ModelRunnerOutput, SchedulerOutput

MAX_IN_FLIGHT = 2


@dataclass
class LaunchedStep:
    """A scheduled step: its runner output (or the future of it, with its execution time) and host timings."""

    sched: SchedulerOutput
    started: float  # time.perf_counter() when scheduling began
    schedule_s: float
    num_prefix_queries: int
    num_prefix_hits: int
    result: ModelRunnerOutput | Future

    def wait(self) -> tuple[ModelRunnerOutput, float]:
        """The runner's output and the seconds it took to execute."""
        if isinstance(self.result, Future):
            return self.result.result()
        return self.result, time.perf_counter() - self.started - self.schedule_s


class StepPipeline:
    """One worker thread that makes every torch call of an engine, its build included; steps are submitted to it
    in order and taken back oldest first.

    One thread for all of it, because on a CPU a second thread entering OpenMP parallel regions halves the step
    (measured: a batch-1 decode step 7.2 -> 14-17 ms, the quantized linears' short regions 3.5 -> 10-12 ms a
    step), and for good: libgomp keeps a thread team per master thread; with more of its threads than cores it
    stops spinning between regions, so every region pays a wake-up, and with OMP_WAIT_POLICY=ACTIVE the idle
    team spins on the other's cores instead. So the engine's build runs here too, and the thread that steps the
    engine must not have run torch's parallel kernels itself.
    """

    def __init__(self) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-step")
        self.in_flight: deque[LaunchedStep] = deque()

    def call(self, fn: Callable[[], object]) -> object:
        """fn() on the worker thread; its result or its exception."""
        return self._worker.submit(fn).result()

    def submit(self, execute: Callable[[SchedulerOutput], ModelRunnerOutput], sched: SchedulerOutput) -> Future:
        return self._worker.submit(_timed, execute, sched)

    @property
    def has_room(self) -> bool:
        return len(self.in_flight) < MAX_IN_FLIGHT

    def push(self, step: LaunchedStep) -> None:
        self.in_flight.append(step)

    def pop(self) -> LaunchedStep:
        return self.in_flight.popleft()


def _timed(execute: Callable[[SchedulerOutput], ModelRunnerOutput], sched: SchedulerOutput
           ) -> tuple[ModelRunnerOutput, float]:
    start = time.perf_counter()
    out = execute(sched)
    return out, time.perf_counter() - start
