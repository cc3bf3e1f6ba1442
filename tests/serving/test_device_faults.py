"""A GPU device-side fault in a step stops the engine for good (its CUDA context is poisoned), and its replica asks to
be replaced; any other step error fails that step's requests and the engine steps on. No GPU here: a model runner
that raises what torch raises on a faulting kernel stands in for one."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import pytest

from conveyor.serving import AsyncEngine
from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig
from conveyor.serving.engine import LLMEngine
from conveyor.serving.engine_client import DeviceFaultError, EngineDeadError, device_fault
from conveyor.serving.engine_core_loop import EXIT_DEVICE_FAULT, _Core
from conveyor.serving.engine_messages import Add, DeviceFault, Reject, Step
from conveyor.serving.engine_process import ProcessEngine
from conveyor.serving.request import SamplingParams

CUDA_FAULT = "CUDA error: an illegal memory access was encountered\nCompile with `TORCH_USE_CUDA_DSA` to enable..."
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class FaultyRunner:
    """The engine's model runner, except that its next `times` executes raise `error`."""

    def __init__(self, runner: Any, error: Exception, times: int = 1) -> None:
        self.runner, self.error, self.times = runner, error, times

    def execute(self, sched: Any) -> Any:
        if self.times > 0:
            self.times -= 1
            raise self.error
        return self.runner.execute(sched)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def _config(model_dir) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(model_dir)), cache=CacheConfig(num_blocks=64, block_size=4))


@pytest.mark.parametrize("text", [CUDA_FAULT, "CUDA error: device-side assert triggered",
                                  "CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, ...)`",
                                  "cudaErrorLaunchFailure: unspecified launch failure"])
def test_cuda_device_faults_are_recognised(text: str) -> None:
    assert device_fault(RuntimeError(text)) == text.splitlines()[0]
    try:
        try:
            raise RuntimeError(text)
        except RuntimeError as inner:
            raise ValueError("while sampling") from inner  # a wrapper keeps the fault as its cause
    except ValueError as outer:
        assert device_fault(outer) == text.splitlines()[0]


@pytest.mark.parametrize("exc", [RuntimeError("shape '[2, 3]' is invalid for input of size 5"),
                                 RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                 RuntimeError("CUDA error: out of memory"),
                                 ValueError("CUDA error: a ValueError is not torch's fault"), KeyError("x")])
def test_other_errors_are_not_device_faults(exc: Exception) -> None:
    assert device_fault(exc) is None


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLMEngine:
    return LLMEngine(_config(tiny_model_dir))


class _CoreUnderTest:
    """The engine process's loop (engine_core_loop._Core) on a thread of this process, behind a real socket pair."""

    def __init__(self, engine: LLMEngine) -> None:
        ours, theirs = socket.socketpair()
        self.parent = Connection(ours.detach())
        self.core = _Core(engine, Connection(theirs.detach()))
        self.core.inbox.start()
        self.raised: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.core.run()
        except BaseException as exc:  # noqa: BLE001 - what ended the loop is the test's evidence
            self.raised.append(exc)

    def add(self, request_id: str, engine: LLMEngine) -> None:
        self.parent.send(Add(request_id, engine.tokenize("The quick brown fox"), GREEDY))

    def receive_until(self, done: Any, timeout_s: float = 30.0) -> list[Any]:
        messages = []
        while self.parent.poll(timeout_s):
            messages.append(self.parent.recv())
            if done(messages[-1]):
                return messages
        raise AssertionError(f"no such message within {timeout_s} s; got {messages}")

    def close(self) -> None:
        self.parent.close()  # the inbox reads EOF: the loop ends
        self.thread.join(10)


def test_a_device_fault_in_a_step_stops_the_engine_process(llm) -> None:
    runner = llm.runner
    llm.runner = FaultyRunner(runner, RuntimeError(CUDA_FAULT))
    core = _CoreUnderTest(llm)
    try:
        core.add("r1", llm)
        messages = core.receive_until(lambda m: isinstance(m, DeviceFault))
        core.thread.join(10)
        assert not core.thread.is_alive()  # it does not step again
        assert [type(e) for e in core.raised] == [DeviceFaultError]  # run_engine_core exits on this
        assert messages[-1].text == CUDA_FAULT.splitlines()[0]
        # Its requests are not rejected here: the parent fails them as at any death, and hands back the unstarted.
        assert not [m for m in messages if isinstance(m, Reject)]
    finally:
        core.close()
        llm.runner = runner
        llm.abort_requests(list(llm.scheduler.requests))
    assert EXIT_DEVICE_FAULT not in (0, 1)  # distinct from a clean exit and from a Python crash


def test_any_other_step_error_fails_that_step_s_requests_and_the_engine_steps_on(llm) -> None:
    runner = llm.runner
    llm.runner = FaultyRunner(runner, RuntimeError("shape '[2, 3]' is invalid for input of size 5"))
    core = _CoreUnderTest(llm)
    try:
        core.add("r1", llm)
        rejected = core.receive_until(lambda m: isinstance(m, Reject))[-1]
        assert (rejected.request_id, rejected.kind) == ("r1", "engine_error")
        core.add("r2", llm)
        steps = core.receive_until(lambda m: isinstance(m, Step) and m.outputs.finish_reasons)
        finished = steps[-1].outputs
        assert [finished.request_ids[i] for i in finished.finish_reasons] == ["r2"]
        assert sum(1 for m in steps if isinstance(m, Step)) == GREEDY.max_tokens
        assert core.thread.is_alive() and not core.raised
    finally:
        core.close()
        llm.runner = runner


def test_the_in_process_engine_stops_on_a_device_fault_and_steps_on_after_other_errors(llm) -> None:
    runner = llm.runner
    engine = AsyncEngine(llm)

    async def collect(request_id: str) -> list:
        return [o async for o in engine.generate("The quick brown fox", GREEDY, request_id)]

    try:
        llm.runner = FaultyRunner(runner, RuntimeError("shape '[2, 3]' is invalid for input of size 5"))
        with pytest.raises(RuntimeError, match="engine step failed"):
            asyncio.run(asyncio.wait_for(collect("a"), 30))
        assert asyncio.run(asyncio.wait_for(collect("b"), 30))[-1].finish_reason == "length"
        assert engine.is_alive() and engine.device_fault is None
        llm.runner = FaultyRunner(runner, RuntimeError(CUDA_FAULT))
        with pytest.raises(DeviceFaultError, match="illegal memory access"):
            asyncio.run(asyncio.wait_for(collect("c"), 30))
        engine._thread.join(10)  # noqa: SLF001
        assert not engine.is_alive()
        assert engine.device_fault == CUDA_FAULT.splitlines()[0]
    finally:
        engine.shutdown()
        llm.runner = runner
        llm.abort_requests(list(llm.scheduler.requests))


@pytest.mark.slow  # starts an engine process of its own (2-6 s): `make test` runs it, the inner loop does not
def test_a_device_fault_ends_the_engine_process_and_every_stream(tiny_model_dir) -> None:
    engine = ProcessEngine.from_config(_config(tiny_model_dir), torch_num_threads=1)
    exits: list[str | None] = []
    engine.on_exit = lambda: exits.append(engine.device_fault)  # the replica's supervisor reads it here

    async def collect() -> list:
        return [o async for o in engine.generate("The quick brown fox", GREEDY)]

    try:
        assert engine._query("device_fault_next_step") is True  # noqa: SLF001 - a test hook of the engine process
        with pytest.raises(DeviceFaultError, match="illegal memory access") as raised:
            asyncio.run(asyncio.wait_for(collect(), 30))
        assert isinstance(raised.value, EngineDeadError)  # so a request with no output yet is handed back
        # The reader thread fails the streams first, then runs the exit hook: wait for it.
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.01)
        assert exits == [engine.device_fault] and "illegal memory access" in engine.device_fault
        assert not engine.is_alive()
        assert engine._process.wait(10) == EXIT_DEVICE_FAULT  # noqa: SLF001
        with pytest.raises(EngineDeadError):
            asyncio.run(asyncio.wait_for(collect(), 5))
    finally:
        engine.shutdown()
