"""A fake model runner for scheduler unit tests: deterministic tokens, no torch, no model."""
from __future__ import annotations

from conveyor.serving.config import SchedulerConfig
from conveyor.serving.kv_cache_manager import KVCacheManager
from conveyor.serving.outputs import ModelRunnerOutput, SchedulerOutput
from conveyor.serving.request import Request, SamplingParams
from conveyor.serving.scheduler import Scheduler
from conveyor.serving.static_scheduler import StaticScheduler

EOS = 0


class FakeRunner:
    """Samples token = 1 + (position % 97), never EOS, and records what each step carried."""

    def __init__(self) -> None:
        self.steps: list[SchedulerOutput] = []

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(sched)
        return ModelRunnerOutput({c.request.request_id: 1 + c.end % 97 for c in sched.chunks if c.samples})


def make_scheduler(num_blocks: int = 64, block_size: int = 4, static: bool = False, max_model_len: int = 4096,
                   prefix_caching: bool = True, sliding_window: int | None = None, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix_caching, sliding_window=sliding_window)
    cls = StaticScheduler if static else Scheduler
    return cls(SchedulerConfig(**config), kv, max_model_len)


def make_request(rid: str, prompt_len: int, max_tokens: int, first_token: int = 1) -> Request:
    prompt = [(first_token + i) % 500 + 1 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=EOS, max_tokens=max_tokens)


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    sched = scheduler.schedule()
    updated = scheduler.update(sched, runner.execute(sched))
    live = {r.request_id for r in scheduler.running} | {r.request_id for r in scheduler.waiting}
    scheduler.kv_cache.check_invariants(live)
    return sched, updated


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> int:
    for num_steps in range(1, max_steps + 1):
        step(scheduler, runner)
        if not scheduler.has_unfinished():
            return num_steps
    raise AssertionError("scheduler did not finish")
