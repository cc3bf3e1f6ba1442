"""CONVEYOR_STEP_TRACE: one JSON line per engine step, in process and from the engine's child process."""
import asyncio
import json

import pytest

from conveyor.serving import LLM, SamplingParams
from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig
from conveyor.serving.engine_process import ProcessEngine
from conveyor.serving.step_trace import ENV_VAR


def read_trace(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_step_is_one_line_with_its_token_counts(tiny_model_dir, tmp_path, monkeypatch):
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv(ENV_VAR, str(trace))
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    results = llm.generate([[5] * 12, [7] * 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    steps = read_trace(trace)
    # A 12-token prompt under an 8-token budget takes two steps to prefill: every step is there, in order.
    assert sum(s["num_prefill_tokens"] for s in steps) == 15
    assert sum(s["num_decode_tokens"] for s in steps) + len(results) == sum(len(r.token_ids) for r in results)
    assert all(s["num_scheduled_tokens"] <= 8 for s in steps)
    assert [s["t"] for s in steps] == sorted(s["t"] for s in steps)
    assert all(s["step_time_s"] > 0 and s["cpu_s"] >= 0 and "forward_s" in s["timings"] for s in steps)


@pytest.mark.slow  # starts an engine process of its own (2-6 s): `make test` runs it, the inner loop does not
def test_the_engine_child_writes_it_too(tiny_model_dir, tmp_path, monkeypatch):
    trace = tmp_path / "child.jsonl"
    monkeypatch.setenv(ENV_VAR, str(trace))
    engine = ProcessEngine(EngineConfig(model=ModelConfig(model=str(tiny_model_dir)), cache=CacheConfig(num_blocks=32)))

    async def run():
        async for out in engine.generate([3] * 5, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)):
            last = out
        return last

    try:
        out = asyncio.run(run())
    finally:
        engine.shutdown()
    steps = read_trace(trace)
    assert len(out.token_ids) == 3
    assert sum(s["num_prefill_tokens"] for s in steps) == 5 and sum(s["num_decode_tokens"] for s in steps) == 2


def test_off_without_the_variable(tiny_model_dir, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert LLM(str(tiny_model_dir), num_kv_blocks=16).engine.step_trace is None
