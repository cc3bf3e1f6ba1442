"""Async scheduling (conveyor/serving/step_pipeline.py): step N+1 is scheduled before step N's tokens are known, and the
output is the synchronous engine's, token for token, through chunked prefill, preemption, prefix hits, stops found
a step late, aborts, penalties and seeded sampling."""
from __future__ import annotations

import asyncio

import pytest

from conveyor.serving import LLM, SamplingParams
from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from conveyor.serving.engine_process import ProcessEngine
from conveyor.serving.outputs import ModelRunnerOutput, SchedulerOutput
from tests.fake_runner import EOS, FakeRunner, make_request, make_scheduler

PROMPTS = ([[(7 * i + j) % 300 + 1 for j in range(5 + 3 * i)] for i in range(10)]
           + [[5, 6, 7, 8, 9, 10, 11, 12, 13] * 2] * 3)  # the last three share a prefix


class StopAtRunner(FakeRunner):
    """FakeRunner's tokens, but EOS at a chosen position for some requests."""

    def __init__(self, eos_at: dict[str, int]) -> None:
        super().__init__()
        self.eos_at = eos_at

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(sched)
        return ModelRunnerOutput({c.request.request_id: EOS if self.eos_at.get(c.request.request_id) == c.end
                                  else 1 + c.end % 97 for c in sched.chunks if c.samples})


def _run_scheduler(ahead: bool, runner: FakeRunner, **config) -> dict[str, tuple[list[int], str]]:
    """Every request to its end. ahead: the engine's pipelined order, step N+1 scheduled before step N's update."""
    scheduler = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=5,
                               async_scheduling=ahead, **config)
    requests = [make_request(f"r{i}", 3 + (5 * i) % 17, 6 + (3 * i) % 11, first_token=i % 3) for i in range(12)]
    for request in requests:
        scheduler.add_request(request)
    in_flight: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    for _ in range(2000):
        if not (scheduler.has_unfinished() or in_flight):
            break
        if scheduler.has_unfinished():
            sched = scheduler.schedule()
            in_flight.append((sched, runner.execute(sched)))
        if len(in_flight) == 2 or not ahead or not scheduler.has_unfinished():
            scheduler.update(*in_flight.pop(0))
            live = {r.request_id for r in scheduler.running} | {r.request_id for r in scheduler.waiting}
            scheduler.kv_cache.check_invariants(live)
    assert not scheduler.has_unfinished() and not in_flight
    assert scheduler.kv_cache.num_free_blocks == 24
    return {r.request_id: (r.output_token_ids, r.status.finish_reason) for r in requests}


def test_scheduler_ahead_gives_the_synchronous_tokens_through_preemption():
    sync = _run_scheduler(False, FakeRunner())
    ahead = _run_scheduler(True, FakeRunner())
    assert ahead == sync
    assert all(reason == "length" for _, reason in sync.values())


def test_scheduler_ahead_drops_the_token_after_a_stop_it_learns_late():
    eos_at = {"r1": 12, "r4": 9, "r7": 14}
    sync = _run_scheduler(False, StopAtRunner(eos_at))
    runner = StopAtRunner(eos_at)
    ahead = _run_scheduler(True, runner)
    assert ahead == sync
    assert {rid for rid, (_, reason) in sync.items() if reason == "stop"} == set(eos_at)
    # The step scheduled while the stopping one ran computed one more token for it, and nothing after.
    late = [c for s in runner.steps for c in s.chunks if c.request.request_id == "r4" and c.start >= 9]
    assert len(late) == 1


def test_scheduler_ahead_never_schedules_past_max_tokens():
    runner = FakeRunner()
    _run_scheduler(True, runner)
    for sched in runner.steps:
        for chunk in sched.chunks:
            request = chunk.request
            # The chunk ending at prompt + max_tokens - 1 samples the last token; one ending later would be waste.
            assert chunk.end < len(request.prompt_token_ids) + request.max_tokens


def _generate(model_dir, ahead: bool, params: SamplingParams, prompts=PROMPTS) -> list:
    llm = LLM(str(model_dir), async_scheduling=ahead, num_kv_blocks=40, block_size=4, max_num_seqs=6,
              max_num_batched_tokens=24)
    results = llm.generate(prompts, params)
    engine = llm.engine
    assert not engine.has_unfinished() and engine.kv_cache.num_free_blocks == 40
    if ahead:
        assert engine.scheduler.num_preemptions_total > 0 and engine.kv_cache.num_prefix_hits > 0
    return [(r.token_ids, r.finish_reason, r.text) for r in results]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=30, temperature=0.0),
    SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=3),
    SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=4),
    SamplingParams(max_tokens=30, temperature=0.0, logprobs=2),
], ids=["greedy", "seeded", "penalties", "logprobs"])
def test_engine_ahead_gives_the_synchronous_output(tiny_model_dir, params):
    assert _generate(tiny_model_dir, True, params) == _generate(tiny_model_dir, False, params)


def test_engine_ahead_stops_where_the_synchronous_engine_stops(tiny_model_dir):
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    free_run = _generate(tiny_model_dir, False, greedy)
    # A token each answer reaches midway becomes a stop token: the async engine finds each stop a step late.
    stop_id = free_run[0][0][5]
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(stop_id,))
    sync = _generate(tiny_model_dir, False, params)
    assert sum(reason == "stop" for _, reason, _ in sync) >= 1
    assert _generate(tiny_model_dir, True, params) == sync


def test_a_request_whose_sampling_reads_its_output_waits_for_its_token(tiny_model_dir):
    """Penalties and min_tokens read the output so far: no step is scheduled while such a request has a token
    in flight (one would sample from a history missing that token whenever the runner got there first)."""
    llm = LLM(str(tiny_model_dir), async_scheduling=True, num_kv_blocks=40, block_size=4, max_num_seqs=6,
              max_num_batched_tokens=24)
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    num_ahead = {"reads_output": 0, "other": 0}

    def checked_schedule() -> SchedulerOutput:
        for request in scheduler.running:
            if request.num_output_placeholders:
                num_ahead["reads_output" if request.sampling_params.reads_output else "other"] += 1
        return schedule()

    scheduler.schedule = checked_schedule
    penalized = SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=0.5)
    llm.generate(PROMPTS[:3], penalized)
    assert num_ahead == {"reads_output": 0, "other": 0}
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=20, temperature=0.0))
    assert num_ahead["reads_output"] == 0 and num_ahead["other"] > 0  # the others do run ahead


def test_rows_and_records_are_released_after_aborts_and_stops(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), async_scheduling=True, num_kv_blocks=40, block_size=4, max_num_seqs=6,
              max_num_batched_tokens=24)
    engine = llm.engine
    ids = []
    for i, prompt in enumerate(PROMPTS):
        request = engine.make_request(prompt, SamplingParams(max_tokens=25, temperature=0.0), f"q{i}")
        engine.add_request(request)
        ids.append(request.request_id)
    for step in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
        if step == 3:
            engine.abort_requests(ids[:4])  # some running, with a token in flight
        live = {rid: engine.kv_cache.block_ids(rid) for rid in engine.kv_cache.block_tables}
        in_flight_ended = {c.request.request_id for s in engine._pipeline.in_flight for c in s.sched.chunks}
        engine.runner.input_batch.check_invariants(live, set(engine.scheduler._finished_ids) | in_flight_ended)
    assert not engine.has_unfinished() and engine.kv_cache.num_free_blocks == 40
    engine.runner.execute(engine.scheduler.schedule())  # hands the runner the last ended ids
    assert engine.runner.input_batch.rows == {} and engine.runner.last_sampled == {}


def test_async_scheduling_needs_the_continuous_scheduler():
    with pytest.raises(ValueError, match="async_scheduling"):
        SchedulerConfig(scheduling="static", async_scheduling=True)


@pytest.mark.slow  # starts an engine process of its own (2-6 s): `make test` runs it, the inner loop does not
def test_the_engine_process_schedules_ahead(tiny_model_dir):
    """The served path's engine (the replica's child process) with the option on: the same stream."""
    async def collect(engine) -> list[int]:
        return [t for o in [o async for o in engine.generate("The quick brown fox", greedy)] for t in o.delta_token_ids]

    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    streams = []
    for ahead in (False, True):
        config = EngineConfig(model=ModelConfig(model=str(tiny_model_dir)),
                              cache=CacheConfig(num_blocks=64, block_size=4),
                              scheduler=SchedulerConfig(async_scheduling=ahead))
        engine = ProcessEngine.from_config(config, torch_num_threads=1)
        try:
            streams.append(asyncio.run(collect(engine)))
        finally:
            engine.shutdown()
    assert streams[0] == streams[1] and len(streams[0]) == 12


def test_decode_inputs_take_a_token_not_yet_appended_from_the_runner_record():
    """The CUDA-graph path's padded decode inputs (cuda_graphs.DecodeInputs) read the same fallback as the eager
    path (input_batch.chunk_token_ids)."""
    from conveyor.serving.cuda_graphs import DecodeInputs
    from conveyor.serving.outputs import ScheduledChunk

    known = make_request("known", 5, 8)
    known.output_token_ids = [41]
    ahead = make_request("ahead", 5, 8)
    ahead.output_token_ids = [42]
    ahead.num_output_placeholders = 1  # its second output token is in flight, not yet appended
    chunks = [ScheduledChunk(known, 5, 1, [0, 1]), ScheduledChunk(ahead, 6, 1, [2, 3])]
    inputs = DecodeInputs(chunks, 4, block_size=4, pad_block=9, last_sampled={"ahead": 77, "known": 41})
    assert inputs.longs[0, :2].tolist() == [41, 77]
    assert inputs.longs[1, :2].tolist() == [5, 6]
