"""Scheduler and KV-cache behaviour with a fake model runner: milliseconds, no torch."""
from __future__ import annotations

import pytest

from conveyor.serving.admission import QueueFullError
from conveyor.serving.request import RequestStatus
from tests.fake_runner import FakeRunner, make_request, make_scheduler, run_to_completion, step


def scheduled_ids(sched) -> set[str]:
    return {c.request.request_id for c in sched.chunks}


def test_new_request_joins_the_step_after_another_finishes():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    runner = FakeRunner()
    short, long_, late = make_request("short", 8, 3), make_request("long", 8, 20), make_request("late", 8, 5)
    for r in (short, long_, late):
        scheduler.add_request(r)
    finished_at = None
    for i in range(30):
        sched, _ = step(scheduler, runner)
        if finished_at is None and short.is_finished:
            finished_at = i
            assert "late" not in scheduled_ids(sched)
        elif finished_at is not None:
            assert "late" in scheduled_ids(sched), "the waiting request must join at the very next step"
            assert long_.status == RequestStatus.RUNNING
            break
    assert finished_at is not None


def test_long_prompt_is_chunked_and_decodes_keep_their_pace():
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=32, max_num_seqs=8)
    runner = FakeRunner()
    streams = [make_request(f"s{i}", 4, 200, first_token=i * 7) for i in range(3)]
    for r in streams:
        scheduler.add_request(r)
    for _ in range(3):
        step(scheduler, runner)
    assert all(r.num_output_tokens >= 1 for r in streams)
    big = make_request("big", 300, 4)
    scheduler.add_request(big)
    steps_while_prefilling = 0
    while big.num_output_tokens == 0:
        before = [r.num_output_tokens for r in streams]
        sched, _ = step(scheduler, runner)
        assert sched.num_scheduled_tokens <= 32
        assert [r.num_output_tokens for r in streams] == [b + 1 for b in before], "a decode missed a step"
        steps_while_prefilling += 1
    # 300 prompt tokens at <= 29 tokens per step (32 minus 3 decodes) take at least 11 steps.
    assert steps_while_prefilling >= 300 // 29


def test_unchunked_prefill_is_possible_to_configure():
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    scheduler.add_request(make_request("too-long", 40, 2))
    sched, _ = step(scheduler, FakeRunner())
    assert sched.is_empty


def test_preemption_under_cache_pressure_then_everyone_completes():
    # 24 blocks of 4 tokens = 96 tokens; 6 requests of 12 + 20 tokens each need 192 at their peak.
    scheduler = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=64, max_num_seqs=6)
    runner = FakeRunner()
    requests = [make_request(f"r{i}", 12, 20, first_token=100 * i) for i in range(6)]
    for r in requests:
        scheduler.add_request(r)
    run_to_completion(scheduler, runner)
    assert scheduler.num_preemptions_total > 0
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 20 for r in requests)
    assert scheduler.kv_cache.num_free_blocks == 24
    # A preempted request recomputes its prompt and its generated tokens, then continues where it was.
    preempted = [r for r in requests if r.num_preemptions]
    assert preempted
    for r in requests:
        assert r.output_token_ids == [1 + (12 + i) % 97 for i in range(20)]


def test_prefix_cache_hits_share_blocks():
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=256)
    runner = FakeRunner()
    first = make_request("a", 30, 2, first_token=5)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)
    second = make_request("b", 30, 2, first_token=5)
    second.prompt_token_ids[-1] = 999  # shares 29 tokens: 7 full blocks of 4
    scheduler.add_request(second)
    sched, _ = step(scheduler, runner)
    assert second.num_cached_tokens == 28
    assert sched.chunks[0].start == 28 and sched.chunks[0].num_tokens == 2
    run_to_completion(scheduler, runner)


def test_identical_prompt_leaves_one_token_to_compute():
    scheduler = make_scheduler(num_blocks=64, block_size=4)
    runner = FakeRunner()
    scheduler.add_request(make_request("a", 16, 2))
    run_to_completion(scheduler, runner)
    again = make_request("b", 16, 2)
    scheduler.add_request(again)
    sched, _ = step(scheduler, runner)
    assert again.num_cached_tokens == 12
    assert sched.chunks[0].num_tokens == 4


def test_concurrent_requests_share_cached_prefix_blocks():
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    runner = FakeRunner()
    a = make_request("a", 20, 10)
    scheduler.add_request(a)
    for _ in range(4):
        step(scheduler, runner)
    b = make_request("b", 20, 10)
    scheduler.add_request(b)
    step(scheduler, runner)
    assert b.num_cached_tokens == 16
    shared = set(scheduler.kv_cache.block_ids("a")[:4]) & set(scheduler.kv_cache.block_ids("b")[:4])
    assert len(shared) == 4
    run_to_completion(scheduler, runner)
    assert a.output_token_ids == b.output_token_ids


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("block_size", [4, 5])
def test_blocks_filled_by_decoding_are_cached(block_size, ahead):
    """A decode fills a block when its token ends on a block boundary (the update registers it only then); a
    later prompt that repeats the whole output hits every block the first request filled."""
    scheduler = make_scheduler(num_blocks=64, block_size=block_size, async_scheduling=ahead)
    runner = FakeRunner()
    first = make_request("a", 6, 15)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)
    second = make_request("b", 6, 2)
    second.prompt_token_ids = first.prompt_token_ids + first.output_token_ids  # 21 tokens
    scheduler.add_request(second)
    step(scheduler, runner)
    # The first computed the KV of 20 tokens (never its last one's), its last decode filling a block: all hit.
    assert second.num_cached_tokens == 20


def test_abort_frees_blocks_at_once_wherever_the_request_is():
    scheduler = make_scheduler(num_blocks=32, max_num_seqs=1)
    runner = FakeRunner()
    running, waiting = make_request("run", 10, 50), make_request("wait", 10, 50)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler, runner)
    scheduler.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache.num_free_blocks == 32 and not scheduler.kv_cache.block_tables
    assert not scheduler.has_unfinished()
    assert set(scheduler.schedule().finished_ids) == {"run", "wait"}


def test_stop_conditions():
    scheduler = make_scheduler()
    runner = FakeRunner()
    eos_req = make_request("eos", 4, 50)
    eos_req.eos_token_id = 1 + 4 % 97  # the fake runner samples this right after the 4-token prompt
    stop_req = make_request("stop-id", 4, 50)
    object.__setattr__(stop_req.sampling_params, "stop_token_ids", (1 + 5 % 97,))
    for r in (eos_req, stop_req):
        scheduler.add_request(r)
    run_to_completion(scheduler, runner)
    assert eos_req.status == RequestStatus.FINISHED_STOPPED and eos_req.num_output_tokens == 1
    assert stop_req.status == RequestStatus.FINISHED_STOPPED and stop_req.num_output_tokens == 2


def test_waiting_queue_is_bounded():
    scheduler = make_scheduler(max_waiting_requests=2, max_waiting_tokens=100, max_num_seqs=1)
    # Two may wait, plus one for the free batch slot: a request at an idle engine is not queued behind anyone.
    for rid in "abc":
        scheduler.add_request(make_request(rid, 10, 5))
    with pytest.raises(QueueFullError):
        scheduler.add_request(make_request("d", 10, 1))
    step(scheduler, FakeRunner())  # "a" now runs: the slot is taken, and the bound is the waiting bound
    with pytest.raises(QueueFullError):
        scheduler.add_request(make_request("d", 10, 1))
    token_bound = make_scheduler(max_waiting_tokens=100)
    token_bound.add_request(make_request("a", 60, 1))
    with pytest.raises(QueueFullError):
        token_bound.add_request(make_request("b", 60, 1))


def test_static_batch_admits_nothing_until_the_longest_member_ends():
    scheduler = make_scheduler(static=True, max_num_seqs=2, max_num_batched_tokens=64)
    runner = FakeRunner()
    a, b, c = make_request("a", 8, 2), make_request("b", 8, 10), make_request("c", 8, 2)
    for r in (a, b, c):
        scheduler.add_request(r)
    while not b.is_finished:
        sched, _ = step(scheduler, runner)
        assert "c" not in scheduled_ids(sched)
    sched, _ = step(scheduler, runner)
    assert scheduled_ids(sched) == {"c"}
    run_to_completion(scheduler, runner)


def test_static_and_continuous_produce_the_same_tokens_continuous_in_fewer_steps():
    def run(static: bool) -> tuple[int, list[list[int]]]:
        scheduler = make_scheduler(num_blocks=256, static=static, max_num_seqs=4, max_num_batched_tokens=64)
        reqs = [make_request(f"r{i}", 5 + 3 * i, 4 + (17 * i) % 23, first_token=i) for i in range(12)]
        for r in reqs:
            scheduler.add_request(r)
        return run_to_completion(scheduler, FakeRunner()), [r.output_token_ids for r in reqs]

    static_steps, static_out = run(True)
    continuous_steps, continuous_out = run(False)
    assert static_out == continuous_out
    assert continuous_steps < static_steps


def test_step_cost_model_recovers_a_linear_cost():
    from conveyor.serving.step_cost import StepCostModel

    model = StepCostModel()
    for i in range(300):
        tokens, seqs, kv = 1 + (i * 37) % 300, 1 + i % 16, (i * 997) % 20_000
        model.observe(tokens, seqs, 0.010 + 0.0002 * tokens + 0.001 * seqs + 1e-6 * kv, kv)
    assert abs(model.predict(100, 8, 5000) - (0.010 + 0.02 + 0.008 + 0.005)) < 1e-3
    # 50 ms over 8 sequences: a fresh prompt's first 122 tokens (0.0002 n + 1e-6 n (n + 1) / 2 <= 0.032; 160 if
    # attention were free). 4 decodes reading 4000 rows leave
    # 0.050 - 0.010 - 4 * 0.0002 - 0.008 - 0.004 = 27.2 ms for prefill; of a prompt already 1 000 tokens long each
    # chunk token costs 0.0002 + 1e-6 * (1000 + k): n = 22 (n * 1.2e-3 + 0.5e-6 * n * (n + 1) <= 0.0272);
    # of one 10 000 tokens long, 10.2 ms each: n = 2.
    model.margin = 1.0  # the fit alone here; the margin has its own test
    assert abs(model.max_tokens_within(0.050, 8) - 122) <= 1
    assert abs(model.max_tokens_within(0.050, 8, 4, 4000, 1_000) - (4 + 22)) <= 1
    assert model.max_tokens_within(0.050, 8, 4, 4000, 10_000) == 4 + 2


def test_tail_latency_mode_sizes_the_budget_from_measured_step_cost():
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=512, itl_slo_ms=50.0, slo_headroom=1.0)
    runner = FakeRunner()
    for i in range(4):
        scheduler.add_request(make_request(f"s{i}", 8, 500, first_token=i))
    assert scheduler.token_budget() == 64  # cold start: small until the cost is known
    # Pretend the hardware costs 10 ms + 0.25 ms per token: 50 ms fits 160 tokens.
    for _ in range(20):
        sched, _ = step(scheduler, runner)
        scheduler.observe_step(sched, 0.010 + 0.00025 * sched.num_scheduled_tokens)
    scheduler.add_request(make_request("long", 1000, 2))
    budget = scheduler.token_budget()
    assert 150 <= budget <= 165
    sched, _ = step(scheduler, runner)
    assert sched.num_scheduled_tokens == budget
    decodes = [c for c in sched.chunks if c.request.request_id != "long"]
    assert len(decodes) == 4 and all(c.num_tokens == 1 for c in decodes)


def test_step_cost_margin_follows_the_noise_of_step_times():
    import random

    from conveyor.serving.step_cost import StepCostModel

    rng = random.Random(0)
    steady, noisy = StepCostModel(), StepCostModel()
    for i in range(2000):
        tokens, seqs = 1 + (i * 37) % 300, 1 + i % 16
        cost = 0.010 + 0.0002 * tokens + 0.001 * seqs
        steady.observe(tokens, seqs, cost)
        # A busy neighbour: one step in ten takes 1.5x as long.
        noisy.observe(tokens, seqs, cost * (1.5 if rng.random() < 0.1 else 1.0))
    assert steady.margin < 1.05
    assert 1.3 < noisy.margin < 1.6, noisy.margin
    assert noisy.max_tokens_within(0.050, 8) < steady.max_tokens_within(0.050, 8)


def _tail_mode_scheduler_with_known_cost(per_token_s: float, **overrides):
    config = {"num_blocks": 512, "max_num_batched_tokens": 512, "itl_slo_ms": 50.0, "slo_headroom": 1.0}
    scheduler = make_scheduler(**(config | overrides))
    runner = FakeRunner()
    for i in range(4):
        scheduler.add_request(make_request(f"s{i}", 8, 500, first_token=i))
    for _ in range(20):
        sched, _ = step(scheduler, runner)
        scheduler.observe_step(sched, 0.010 + per_token_s * sched.num_scheduled_tokens)
    return scheduler, runner


def test_tail_latency_mode_keeps_a_long_prompt_moving_when_decodes_fill_the_target():
    # 10 ms + 12 ms per token: four decodes alone (58 ms) already exceed the 50 ms target.
    scheduler, runner = _tail_mode_scheduler_with_known_cost(0.012, min_prefill_tokens=16, max_num_seqs=8)
    long_ = make_request("long", 100, 2)
    scheduler.add_request(long_)
    scheduler.running.append(scheduler.waiting.popleft())  # already admitted: its prefill is pending
    long_.status = RequestStatus.RUNNING
    assert scheduler.token_budget() == 4 + 16
    sched, _ = step(scheduler, runner)
    assert {c.request.request_id: c.num_tokens for c in sched.chunks} == {"s0": 1, "s1": 1, "s2": 1, "s3": 1,
                                                                           "long": 16}


def test_tail_latency_mode_caps_the_batch_where_one_more_decode_breaks_the_target():
    # 10 ms + 9 ms per token: a decode step over 4 sequences is predicted at 46 ms, over 5 at 55 ms.
    scheduler, runner = _tail_mode_scheduler_with_known_cost(0.009, max_num_seqs=8)
    scheduler.add_request(make_request("late", 8, 4))
    for _ in range(3):
        sched, _ = step(scheduler, runner)
        assert "late" not in scheduled_ids(sched)
    assert scheduler.num_waiting == 1
    scheduler.finish_requests(["s0", "s1"], RequestStatus.FINISHED_ABORTED)
    sched, _ = step(scheduler, runner)
    assert "late" in scheduled_ids(sched)


def test_overload_shedding_refuses_what_would_wait_too_long_for_a_slot():
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=2, max_queue_wait_s=2.0)
    runner = FakeRunner()
    scheduler.add_request(make_request("short", 8, 12))
    scheduler.add_request(make_request("long", 8, 52))
    for _ in range(2):  # prefill (first token), then one decode: 10 and 50 tokens to go
        sched, _ = step(scheduler, runner)
        scheduler.observe_step(sched, 0.1)
    scheduler._mean_step_s = 0.1  # the average has not converged after two steps; pin it for the arithmetic
    assert scheduler.expected_queue_wait_s() == pytest.approx(1.0)  # the first slot frees when "short" ends
    scheduler.add_request(make_request("first-in-line", 8, 4))
    assert scheduler.expected_queue_wait_s() == pytest.approx(5.0)  # the next one only when "long" ends
    with pytest.raises(QueueFullError) as refused:
        scheduler.add_request(make_request("too-late", 8, 4))
    assert refused.value.retry_after_s == pytest.approx(5.0)
    assert scheduler.num_waiting == 1 and "too-late" not in scheduler.requests
