"""Stream batching (EngineConfig.stream_batching_interval_ms): decode steps' outputs wait in the engine process and
leave together, while first tokens, last tokens and every other message leave at once and in order."""
from __future__ import annotations

import asyncio

import pytest

from conveyor.serving import EngineConfig, SamplingParams
from conveyor.serving import engine_messages as msg
from conveyor.serving.config import CacheConfig, ModelConfig
from conveyor.serving.engine_process import ProcessEngine
from conveyor.serving.output_processor import CoreOutputs, RequestTimes
from conveyor.serving.outputs import EngineStepStats
from conveyor.serving.step_batching import StepBatcher
from tests.polling import poll_until

LOAD = msg.CoreLoad(0, 1, 0.0, 8, 0.0, 1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _step(*, first: bool = False, finished: bool = False) -> msg.Step:
    outputs = CoreOutputs(request_ids=["a"], token_ids=[7])
    if first:
        outputs.times[0] = RequestTimes(3, 0, 0.0, None, None)
    if finished:
        outputs.finish_reasons[0] = "length"
    return msg.Step(outputs, EngineStepStats(), LOAD)


def test_without_an_interval_every_step_leaves_alone() -> None:
    batcher = StepBatcher(0.0)
    step = _step()
    assert batcher.add(step) is step
    assert batcher.num_held == 0 and batcher.take() is None


def test_decode_steps_wait_until_the_interval_has_passed_then_leave_in_order() -> None:
    clock = Clock()
    batcher = StepBatcher(0.05, clock)
    steps = [_step() for _ in range(3)]
    assert batcher.add(steps[0]) is None
    clock.now += 0.02
    assert batcher.add(steps[1]) is None
    clock.now += 0.031
    sent = batcher.add(steps[2])
    assert isinstance(sent, msg.StepBatch) and sent.steps == steps
    assert batcher.num_held == 0


@pytest.mark.parametrize("kind", ["first", "finished"])
def test_a_first_or_last_token_leaves_at_once_with_what_was_held(kind: str) -> None:
    clock = Clock()
    batcher = StepBatcher(10.0, clock)
    held = _step()
    assert batcher.add(held) is None
    urgent = _step(**{kind: True})
    sent = batcher.add(urgent)
    assert isinstance(sent, msg.StepBatch) and sent.steps == [held, urgent]


def test_held_outputs_leave_before_a_step_that_would_carry_them_past_the_interval() -> None:
    clock = Clock()
    batcher = StepBatcher(0.05, clock)
    assert not batcher.due_within(1.0)  # nothing held
    batcher.add(_step())
    clock.now += 0.01
    assert not batcher.due_within(0.01)
    assert batcher.due_within(0.04)
    assert isinstance(batcher.take(), msg.Step)


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="stream_batching_interval_ms"):
        EngineConfig(stream_batching_interval_ms=-1)


# ---- through the engine process ------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _config(model_dir, interval_ms: float) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(model_dir)), cache=CacheConfig(num_blocks=64, block_size=4),
                        stream_batching_interval_ms=interval_ms)


async def _collect(engine, prompt: str, params: SamplingParams = GREEDY) -> list:
    return [o async for o in engine.generate(prompt, params)]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    every_step = ProcessEngine.from_config(_config(tiny_model_dir, 0.0), torch_num_threads=1)
    batched = ProcessEngine.from_config(_config(tiny_model_dir, 60_000.0), torch_num_threads=1)
    yield every_step, batched
    every_step.shutdown()
    batched.shutdown()


def test_a_batched_stream_has_the_same_tokens_with_the_first_at_once_and_the_rest_at_the_end(engines) -> None:
    every_step, batched = engines
    expected = asyncio.run(_collect(every_step, "The quick brown fox"))
    streamed = asyncio.run(_collect(batched, "The quick brown fox"))
    assert len(expected) == GREEDY.max_tokens
    # An interval longer than the request: its first token, then everything else with its last.
    assert [len(o.delta_token_ids) for o in streamed] == [1, GREEDY.max_tokens - 1]
    assert streamed[-1].token_ids == expected[-1].token_ids
    assert streamed[-1].text == expected[-1].text and streamed[-1].finish_reason == "length"


def test_a_stop_string_ends_a_batched_stream_where_it_ends_an_unbatched_one(engines) -> None:
    """The parent finds stop strings: tokens the engine computed past the stop while its outputs were held must not
    leak into the stream."""
    every_step, batched = engines
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = asyncio.run(_collect(every_step, "The quick brown fox", free))[-1].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"pick a stop string inside {full!r}"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    expected = asyncio.run(_collect(every_step, "The quick brown fox", params))
    streamed = asyncio.run(_collect(batched, "The quick brown fox", params))
    assert streamed[-1].finish_reason == expected[-1].finish_reason == "stop"
    assert streamed[-1].text == expected[-1].text == full[:full.index(stop)]
    # The abort reached the engine process: nothing of the request runs there.
    assert poll_until(lambda: batched.load().num_running == 0, 10.0)


def test_concurrent_batched_streams_each_get_all_their_tokens(engines) -> None:
    every_step, batched = engines
    prompts = ["The quick brown fox", "Once upon a time", "In a hole in the ground"]

    async def run(engine) -> list:
        return await asyncio.gather(*(_collect(engine, p) for p in prompts))

    expected = asyncio.run(run(every_step))
    streamed = asyncio.run(run(batched))
    assert [s[-1].token_ids for s in streamed] == [e[-1].token_ids for e in expected]
    assert all(s[-1].finished for s in streamed)
