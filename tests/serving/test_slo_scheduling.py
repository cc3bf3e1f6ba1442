"""SLO-aware scheduling with a fake model runner: steps sized to the TPOT target, admission by predicted TTFT."""
from __future__ import annotations

import pytest

from conveyor.serving.admission import QueueFullError
from tests.fake_runner import FakeRunner, make_request, make_scheduler, step

BASE_S, PER_TOKEN_S = 0.010, 0.0005  # the pretend hardware: 10 ms a step + 0.5 ms a token


def _scheduler_with_known_cost(num_streams: int = 4, **overrides):
    """A scheduler whose step-cost model has learned BASE_S + PER_TOKEN_S * tokens from num_streams decoding."""
    config = {"num_blocks": 2048, "max_num_batched_tokens": 512, "max_num_seqs": 32, "slo_headroom": 1.0,
              "tpot_slo_ms": 100.0, "ttft_slo_ms": 2000.0} | overrides
    scheduler = make_scheduler(**config)
    runner = FakeRunner()
    for i in range(num_streams):
        scheduler.add_request(make_request(f"s{i}", 8, 1000, first_token=i))
    for _ in range(30):
        sched, _ = step(scheduler, runner)
        scheduler.observe_step(sched, BASE_S + PER_TOKEN_S * sched.num_scheduled_tokens)
    return scheduler, runner


def test_tpot_target_sizes_the_prefill_chunk_by_the_mean_step_cost():
    scheduler, runner = _scheduler_with_known_cost()
    # A noisy host raises the tracked tail margin; the TPOT target plans against the mean and ignores it.
    scheduler.step_cost.margin = 2.0
    scheduler.add_request(make_request("long", 1000, 2))
    # 100 ms = 10 ms + 0.5 ms x (4 decodes + n): n = 176.
    sched, _ = step(scheduler, runner)
    chunks = {c.request.request_id: c.num_tokens for c in sched.chunks}
    assert abs(chunks.pop("long") - 176) <= 2
    assert chunks == {f"s{i}": 1 for i in range(4)}


def test_a_step_without_decodes_takes_the_whole_token_budget():
    scheduler, runner = _scheduler_with_known_cost(num_streams=1)
    scheduler.finish_requests(["s0"], scheduler.running[0].status.FINISHED_ABORTED)
    scheduler.add_request(make_request("long", 1000, 2))
    sched, _ = step(scheduler, runner)
    assert sched.num_scheduled_tokens == 512


def test_without_latency_targets_the_budget_is_fixed():
    scheduler, runner = _scheduler_with_known_cost(tpot_slo_ms=None, ttft_slo_ms=None)
    scheduler.add_request(make_request("long", 1000, 2))
    sched, _ = step(scheduler, runner)
    assert sched.num_scheduled_tokens == 512


def test_ttft_admission_refuses_what_would_wait_past_the_target():
    scheduler, _ = _scheduler_with_known_cost()
    # Each 100 ms step prefills ~176 tokens: 2 s (x headroom 1.0) covers ~3,500 queued prompt tokens.
    for i in range(3):
        scheduler.add_request(make_request(f"q{i}", 1000, 8, first_token=100 + i))
    with pytest.raises(QueueFullError) as refused:
        scheduler.add_request(make_request("late", 1000, 8, first_token=200))
    assert refused.value.reason == "ttft_slo"
    assert refused.value.retry_after_s >= 1.0
    assert scheduler.num_refused_ttft == 1
    assert "late" not in scheduler.requests
    scheduler.add_request(make_request("short", 100, 8, first_token=300))  # still fits in front of the target


def test_queue_policy_admits_what_would_wait_past_the_target():
    scheduler, _ = _scheduler_with_known_cost(admission_policy="queue")
    for i in range(6):
        scheduler.add_request(make_request(f"q{i}", 1000, 8, first_token=100 + i))
    assert scheduler.num_waiting == 6 and scheduler.num_refused_ttft == 0


def test_nothing_ahead_means_no_ttft_refusal():
    scheduler, _ = _scheduler_with_known_cost()
    # Only decodes run: a prompt too long to meet the target alone would miss it at any time; refusing it helps
    # no one.
    scheduler.add_request(make_request("huge", 8000, 8))
    assert scheduler.num_waiting == 1


def test_static_baseline_ignores_latency_targets():
    scheduler = make_scheduler(static=True, tpot_slo_ms=100.0, ttft_slo_ms=1.0)
    assert scheduler.config.tpot_slo_ms is None and scheduler.config.ttft_slo_ms is None


@pytest.mark.parametrize("field", ["tpot_slo_ms", "ttft_slo_ms", "itl_slo_ms"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_latency_targets_must_be_positive_and_finite(field, value):
    with pytest.raises(ValueError, match=field):
        make_scheduler(**{field: value})


def test_unknown_admission_policy_is_refused():
    with pytest.raises(ValueError, match="admission_policy"):
        make_scheduler(admission_policy="drop")


def _long_prompt_chunk(scheduler, runner, now: float) -> int:
    scheduler.clock = lambda: now
    scheduler.add_request(make_request("long", 1000, 2))
    sched, _ = step(scheduler, runner)
    return {c.request.request_id: c.num_tokens for c in sched.chunks}["long"]


def _pace_streams(scheduler, first_token_time: float) -> None:
    for r in scheduler.running:
        r.first_token_time = first_token_time


def test_streams_ahead_of_their_tpot_pace_let_a_step_carry_more_prefill():
    scheduler, runner = _scheduler_with_known_cost(tpot_credit_max=1.0)
    # Each stream has ~30 tokens out: at a 100 ms target its pace allows t_first + 2.9 s for the next token;
    # started 1 s ago it is 1.9 s ahead, so the step may take 100 ms + 1 x 100 ms (the cap): 10 + 0.5 (4 + n)
    # <= 200 ms, n = 376.
    _pace_streams(scheduler, first_token_time=99.0)
    assert abs(_long_prompt_chunk(scheduler, runner, now=100.0) - 376) <= 2


def test_a_stream_behind_its_pace_gives_no_credit():
    scheduler, runner = _scheduler_with_known_cost(tpot_credit_max=3.0)
    _pace_streams(scheduler, first_token_time=99.0)
    scheduler.running[0].first_token_time = 90.0  # 10 s for ~30 tokens: far behind a 100 ms pace
    assert abs(_long_prompt_chunk(scheduler, runner, now=100.0) - 176) <= 2


def test_credit_is_bounded_by_the_time_ahead_of_pace():
    scheduler, runner = _scheduler_with_known_cost(tpot_credit_max=3.0)
    n = len(scheduler.running[0].output_token_ids)
    # 50 ms ahead of pace: the step may take 150 ms, 10 + 0.5 (4 + n) <= 150 ms, n = 276.
    _pace_streams(scheduler, first_token_time=100.0 - 0.1 * (n - 1) + 0.05)
    assert abs(_long_prompt_chunk(scheduler, runner, now=100.0) - 276) <= 2


def test_no_credit_when_switched_off():
    scheduler, runner = _scheduler_with_known_cost(tpot_credit_max=0.0)
    _pace_streams(scheduler, first_token_time=99.0)
    assert abs(_long_prompt_chunk(scheduler, runner, now=100.0) - 176) <= 2


def test_a_short_backlog_is_charged_its_own_tokens_not_whole_steps():
    scheduler, _ = _scheduler_with_known_cost(ttft_slo_ms=150.0)
    # 200 tokens ahead of and including "next", ~176 a step: 2 steps of 10 ms + 4 decodes, plus 200 x 0.5 ms
    # = 124 ms, under 150 ms. Charging two full 100 ms steps would refuse it.
    for i in range(3):
        scheduler.add_request(make_request(f"q{i}", 50, 8, first_token=100 + i))
    scheduler.add_request(make_request("next", 50, 8, first_token=200))
    with pytest.raises(QueueFullError):
        scheduler.add_request(make_request("over", 100, 8, first_token=300))  # 300 tokens: 2 steps, 174 ms


def _on_pace(scheduler, now: float) -> None:
    """Every stream exactly on its TPOT pace (100 ms a token): no credit from the time already spent."""
    for r in scheduler.running:
        r.first_token_time = now - 0.1 * (len(r.output_token_ids) - 1)


def _chunk_after_finished(lengths_of, tpot_credit_max: float = 1.0) -> int:
    """The long prompt's chunk with every stream on pace, once requests of lengths_of(n) have finished (n: the
    first stream's output tokens so far)."""
    scheduler, runner = _scheduler_with_known_cost(tpot_credit_max=tpot_credit_max)
    for length in lengths_of(len(scheduler.running[0].output_token_ids)):
        scheduler.budget.output_lengths.add(length)
    _on_pace(scheduler, now=100.0)
    return _long_prompt_chunk(scheduler, runner, now=100.0)


def test_a_stream_expected_to_go_on_lends_the_step_its_future_slack():
    # ~170 more tokens, each ~88 ms under the target at the ~12 ms pace: far more than the cap, 100 ms + 1 x 100
    # ms: 10 + 0.5 (4 + n) <= 200 ms, n = 376.
    assert abs(_chunk_after_finished(lambda n: [200] * 64) - 376) <= 2


def test_no_future_slack_from_requests_no_longer_than_the_stream():
    # Shorter, as long as it, or ending on the very next token: nothing to amortize.
    assert abs(_chunk_after_finished(lambda n: [5, n, n + 1] * 64, tpot_credit_max=3.0) - 176) <= 2


def test_future_slack_needs_enough_finished_requests_and_can_be_switched_off():
    assert abs(_chunk_after_finished(lambda n: [200] * 31) - 176) <= 2
    assert _scheduler_with_known_cost(tpot_credit_quantile=None)[0].budget.output_lengths is None


def test_output_lengths_take_a_lower_quantile_of_the_longer_requests_in_a_window():
    from conveyor.serving.step_budget import OutputLengths

    lengths = OutputLengths(quantile=0.1, window=100, min_samples=10)
    for n in range(1, 201):  # the window keeps 101..200
        lengths.add(n)
    assert lengths.lower_bound(0) == 111  # 10 of the 100 lie below it
    assert lengths.lower_bound(150) == 156  # among 151..200
    assert lengths.lower_bound(195) == 195  # only 5 longer: too few to say
