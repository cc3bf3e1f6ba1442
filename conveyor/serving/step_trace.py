"""A per-step trace for diagnosis: CONVEYOR_STEP_TRACE=FILE appends one JSON line per engine step to FILE.

The Prometheus histograms say how long steps take on average; comparing two set-ups needs the steps themselves:
the same workload behind `conveyor serve` and in process runs the same steps, and only a trace of each shows
whether the served ones are slower at equal batch composition (and whether the engine waits between steps,
or spins). A line holds
the step's EngineStepStats (timings included), `t` (time.monotonic(), comparable across processes on one host)
and `cpu_s`, the CPU this process used since the previous step (all its threads: more than 2x the step time on
two cores means threads spun or were stalled, not computing). Off unless the variable is set.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import IO

from conveyor import envs
from conveyor.serving.outputs import EngineStepStats

ENV_VAR = envs.STEP_TRACE


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - line-buffered, open until the process exits
        self._last_cpu_s = time.process_time()

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = envs.get(ENV_VAR).strip()
        return cls(path) if path else None

    def write(self, stats: EngineStepStats) -> None:
        cpu_s = time.process_time()
        record = dataclasses.asdict(stats) | {"t": time.monotonic(), "cpu_s": cpu_s - self._last_cpu_s}
        self._last_cpu_s = cpu_s
        self._file.write(json.dumps(record) + "\n")
