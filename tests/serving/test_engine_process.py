"""ProcessEngine: the engine stepping in a child process behaves as AsyncEngine does, and the child never
outlives its parent or leaves a stream hanging."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from conveyor.serving import AsyncEngine, EngineConfig, SamplingParams
from conveyor.serving.admission import QueueFullError
from conveyor.serving.config import CacheConfig, ModelConfig, SchedulerConfig
from conveyor.serving.engine import LLMEngine
from conveyor.serving.engine_client import EngineDeadError
from conveyor.serving.engine_process import ProcessEngine
from tests.polling import poll_until

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _config(model_dir, **sched) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(model_dir)), cache=CacheConfig(num_blocks=64, block_size=4),
                        scheduler=SchedulerConfig(**sched))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = ProcessEngine.from_config(_config(tiny_model_dir), torch_num_threads=1)
    yield engine
    engine.shutdown()
    assert not engine.is_alive()


async def _collect(engine, prompt, params=GREEDY) -> list:
    return [o async for o in engine.generate(prompt, params)]


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    return poll_until(predicate, timeout_s)


def test_streams_the_same_tokens_as_the_in_process_engine(engine, tiny_model_dir):
    local = AsyncEngine(LLMEngine(_config(tiny_model_dir)))
    try:
        expected = asyncio.run(_collect(local, "The quick brown fox"))
    finally:
        local.shutdown()
    streamed = asyncio.run(_collect(engine, "The quick brown fox"))
    assert [o.delta_token_ids for o in streamed] == [o.delta_token_ids for o in expected]
    # Outputs cross without their running totals; the parent rebuilds them.
    assert streamed[-1].token_ids == [t for o in streamed for t in o.delta_token_ids]
    assert streamed[-1].text == "".join(o.delta_text for o in streamed) == expected[-1].text
    assert streamed[-1].finished and streamed[-1].finish_reason == "length"


def test_stop_strings_end_the_stream_as_in_process_and_free_the_request(engine, tiny_model_dir):
    """The parent finds the stop string (it detokenizes) and aborts the request in the child: the stream ends
    exactly where the in-process engine ends it, and no token computed after the stop leaks out."""
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = asyncio.run(_collect(engine, "The quick brown fox", free))[-1].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"pick a stop string inside {full!r}"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    local = AsyncEngine(LLMEngine(_config(tiny_model_dir)))
    try:
        expected = asyncio.run(_collect(local, "The quick brown fox", params))
    finally:
        local.shutdown()
    streamed = asyncio.run(_collect(engine, "The quick brown fox", params))
    assert streamed[-1].finish_reason == expected[-1].finish_reason == "stop"
    assert streamed[-1].text == expected[-1].text == full[:full.index(stop)]
    assert [o.delta_token_ids for o in streamed] == [o.delta_token_ids for o in expected]
    assert _wait_for(lambda: engine.block_state()["num_block_tables"] == 0)


def test_closing_a_stream_aborts_it_and_frees_its_blocks(engine):
    async def main():
        gen = engine.generate("The quick brown fox", SamplingParams(max_tokens=200, ignore_eos=True))
        async for _ in gen:
            break
        await gen.aclose()

    asyncio.run(main())
    assert _wait_for(lambda: engine.block_state()["num_block_tables"] == 0)
    state = engine.block_state()
    assert state["num_free_blocks"] == state["num_blocks"] == 64
    assert _wait_for(lambda: engine.load().num_running == 0)


def test_bad_input_is_a_value_error_before_any_output(engine):
    with pytest.raises(ValueError, match="context"):
        asyncio.run(_collect(engine, "x " * 2000))
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(_collect(engine, ""))
    assert len(asyncio.run(_collect(engine, "still serving"))) == GREEDY.max_tokens


def test_step_listeners_see_every_generated_token(engine):
    seen: list[int] = []
    engine.add_step_listener(lambda stats, outputs: seen.append(
        sum(len(o.delta_token_ids) for o in outputs if o.request_id == "count-me")))

    async def main():
        return [o async for o in engine.generate("count me", GREEDY, request_id="count-me")]

    asyncio.run(main())
    assert _wait_for(lambda: sum(seen) >= GREEDY.max_tokens)
    assert sum(seen) == GREEDY.max_tokens


@pytest.mark.slow  # starts an engine process of its own (2-6 s): `make test` runs it, the inner loop does not
def test_refuses_past_the_queue_bound(tiny_model_dir):
    engine = ProcessEngine.from_config(_config(tiny_model_dir, max_waiting_requests=1, max_num_seqs=1), 1)

    async def main():
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        gens = [engine.generate("The quick", params) for _ in range(6)]
        results = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
        for g in gens:
            await g.aclose()
        return results

    try:
        results = asyncio.run(main())
        assert any(isinstance(r, QueueFullError) for r in results)
        assert any(not isinstance(r, BaseException) for r in results)
        assert _wait_for(lambda: engine.block_state()["num_block_tables"] == 0)
    finally:
        engine.shutdown()


@pytest.mark.slow  # starts an engine process of its own (2-6 s): `make test` runs it, the inner loop does not
def test_a_dead_engine_process_fails_its_streams(tiny_model_dir):
    engine = ProcessEngine.from_config(_config(tiny_model_dir), 1)

    async def main():
        gen = engine.generate("The quick", SamplingParams(max_tokens=200, ignore_eos=True))
        await gen.__anext__()
        engine._process.kill()  # noqa: SLF001 - a crash of the child, as the OOM killer would do it
        with pytest.raises(RuntimeError, match="engine process stopped"):
            async for _ in gen:
                pass

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert _wait_for(lambda: not engine.is_alive())
    finally:
        engine.shutdown()


def test_an_exception_on_one_message_fails_that_request_only(engine):
    async def main():
        live = engine.generate("The quick", SamplingParams(max_tokens=30, ignore_eos=True))
        first = await live.__anext__()
        assert engine._query("fail_next_add") is True  # noqa: SLF001 - the child's next Add raises, as a bug would
        with pytest.raises(RuntimeError, match="injected failure"):
            await _collect(engine, "brown fox")
        return [first] + [o async for o in live]

    outputs = asyncio.run(asyncio.wait_for(main(), 30))
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert sum(len(o.delta_token_ids) for o in outputs) == 30
    assert engine.is_alive()
    assert asyncio.run(_collect(engine, "The quick"))[-1].finish_reason == "length"
    assert _wait_for(lambda: not any(engine.request_state().values()))


@pytest.mark.slow  # starts an engine process of its own (2-6 s): `make test` runs it, the inner loop does not
def test_no_stream_waits_on_a_dead_engine_process(tiny_model_dir):
    engine = ProcessEngine.from_config(_config(tiny_model_dir), 1)
    exits = []
    engine.on_exit = lambda: exits.append(engine.is_alive())  # the replica restarts its engine from this hook
    try:
        engine._process.kill()  # noqa: SLF001
        assert _wait_for(lambda: not engine.is_alive())
        assert exits == [False]

        async def late():
            with pytest.raises(EngineDeadError, match="engine process"):
                await _collect(engine, "The quick")

        asyncio.run(asyncio.wait_for(late(), 5))
    finally:
        engine.shutdown()


@pytest.mark.slow  # starts an engine process of its own (2-6 s): `make test` runs it, the inner loop does not
def test_the_engine_process_exits_with_its_parent(tiny_model_dir):
    # The parent dies without any cleanup (SIGKILL, as ray.kill does to a replica): its end of the socket
    # closes with it, and the child must notice and exit rather than hold the model's memory forever.
    script = textwrap.dedent(f"""
        import os, sys
        from conveyor.serving.engine_process import ProcessEngine
        from tests.serving.test_engine_process import _config
        engine = ProcessEngine.from_config(_config({str(tiny_model_dir)!r}), 1)
        print(engine._process.pid, flush=True)
        os._exit(0)
    """)
    parent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert parent.returncode == 0, parent.stderr[-2000:]
    child_pid = int(parent.stdout.split()[-1])
    assert _wait_for(lambda: not _alive(child_pid), timeout_s=15), f"engine process {child_pid} outlived its parent"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_the_engine_process_spins_briefly_at_barriers(engine):
    """Its OpenMP threads sleep after a short spin (openmp_runtime.ENGINE_OMP_SPIN_COUNT on GNU's runtime,
    ENGINE_KMP_BLOCKTIME_MS on Intel's), unless the environment says otherwise."""
    from conveyor.serving.openmp_runtime import ENGINE_KMP_BLOCKTIME_MS, ENGINE_OMP_SPIN_COUNT, engine_child_env

    environ = open(f"/proc/{engine._process.pid}/environ", "rb").read().split(b"\0")
    expected_spins = os.environ.get("GOMP_SPINCOUNT", ENGINE_OMP_SPIN_COUNT)
    expected_blocktime = os.environ.get("KMP_BLOCKTIME", ENGINE_KMP_BLOCKTIME_MS)
    assert f"GOMP_SPINCOUNT={expected_spins}".encode() in environ
    assert f"KMP_BLOCKTIME={expected_blocktime}".encode() in environ
    gnu = {"CONVEYOR_ENGINE_OPENMP": "gnu"}
    told = {"GOMP_SPINCOUNT": "5", "KMP_BLOCKTIME": "200", "A": "b"}
    assert engine_child_env(told | gnu) == told | gnu
    assert engine_child_env({"A": "b"} | gnu) == {"A": "b", "GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"} | gnu


def test_the_child_runs_on_intel_s_openmp_when_it_is_installed(engine):
    from conveyor.serving.openmp_runtime import intel_openmp_library

    assert engine.info["openmp_runtime"] == ("intel" if intel_openmp_library() else "gnu")


def test_the_in_process_engine_also_fails_only_the_request_that_raised(tiny_model_dir):
    llm = LLMEngine(_config(tiny_model_dir))
    real_add = llm.add_request

    def add(request, **kwargs):  # noqa: ANN001, ANN202 - a fault in the engine on one request, as a bug would be
        if request.request_id == "bad":
            raise RuntimeError("injected failure")
        return real_add(request, **kwargs)

    llm.add_request = add
    engine = AsyncEngine(llm)

    async def main():
        good = engine.generate("The quick", GREEDY, request_id="good")
        first = await good.__anext__()
        with pytest.raises(RuntimeError, match="injected failure"):
            _ = [o async for o in engine.generate("brown fox", GREEDY, request_id="bad")]
        return [first] + [o async for o in good]

    try:
        outputs = asyncio.run(asyncio.wait_for(main(), 30))
        assert outputs[-1].finish_reason == "length" and sum(len(o.delta_token_ids) for o in outputs) == 12
        assert engine.is_alive()
    finally:
        engine.shutdown()


@pytest.mark.slow  # starts an engine process of its own (2-6 s): `make test` runs it, the inner loop does not
def test_a_team_with_a_thread_for_every_cpu_runs_one_thread_on_each(tiny_model_dir):
    """The child's runtime honours the binding openmp_runtime.thread_binding_env sets: each CPU this process may
    use has one of the team's threads bound to it alone (the main thread, then the runtime's workers)."""
    from conveyor.serving.openmp_runtime import BIND_ENV, BINDING_VARS

    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2 or any(var in os.environ for var in BINDING_VARS) or os.environ.get(BIND_ENV) == "off":
        pytest.skip("one CPU, or the environment binds the threads itself")
    engine = ProcessEngine.from_config(_config(tiny_model_dir), torch_num_threads=len(cpus))
    try:
        assert len(asyncio.run(_collect(engine, "The quick brown fox"))) > 0  # a step ran: the team exists
        pid = engine._process.pid
        masks = [frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")]
        assert {mask for mask in masks if len(mask) == 1} == {frozenset({cpu}) for cpu in cpus}
    finally:
        engine.shutdown()
