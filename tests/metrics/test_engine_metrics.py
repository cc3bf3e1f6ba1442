"""EngineMetrics fed synthetic engine steps: what a replica's registry exposes afterwards."""
from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, generate_latest

from conveyor.serving import metrics as m
from conveyor.serving.outputs import EngineStepStats, RequestOutput


def _out(rid: str, t0: float, first: float, finished: bool = False,
         reason: str | None = None) -> RequestOutput:
    return RequestOutput(request_id=rid, delta_text="x", delta_token_ids=[7], text="", token_ids=[],
                         num_prompt_tokens=5, finished=finished, finish_reason=reason, arrival_time=t0,
                         first_token_time=first)


def _value(name: str, **labels: str) -> float:
    v = REGISTRY.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_step_and_request_lifecycle() -> None:
    em = m.EngineMetrics("unit-model", "r-lifecycle")
    lab = {"model": "unit-model", "replica": "r-lifecycle"}
    stats = EngineStepStats(step_time_s=0.02, num_scheduled_tokens=12, num_prefill_tokens=10,
                            num_decode_tokens=2, batch_size=3, num_running=3, num_waiting=4,
                            kv_cache_usage=0.25, num_preemptions=1, num_prefix_cache_queries=4,
                            num_prefix_cache_hits=3)
    # step 1 at t=100.1: first tokens of a and b (arrived at 100.0)
    em.observe_step(stats, [_out("a", 100.0, 100.1), _out("b", 100.0, 100.1)], now=100.1)
    # step 2 at t=100.15: a continues (ITL 0.05), b finishes (ITL 0.05, e2e 0.15)
    em.observe_step(stats, [_out("a", 100.0, 100.1), _out("b", 100.0, 100.1, True, "length")], now=100.15)
    assert len(em._last_token) == 1  # b's timestamp dropped at finish
    assert _value("conveyor_time_to_first_token_seconds_count", **lab) == 2
    assert _value("conveyor_time_to_first_token_seconds_sum", **lab) == pytest.approx(0.2)
    assert _value("conveyor_inter_token_latency_seconds_count", **lab) == 2
    assert _value("conveyor_inter_token_latency_seconds_sum", **lab) == pytest.approx(0.1)
    assert _value("conveyor_e2e_request_latency_seconds_count", **lab) == 1
    # queue time: first token time minus the producing step's duration minus arrival
    assert _value("conveyor_request_queue_time_seconds_sum", **lab) == pytest.approx(2 * 0.08)
    assert _value("conveyor_step_duration_seconds_count", **lab) == 2
    assert _value("conveyor_requests_running", **lab) == 3
    assert _value("conveyor_requests_waiting", **lab) == 4
    assert _value("conveyor_kv_cache_usage_ratio", **lab) == 0.25
    assert _value("conveyor_batch_size", **lab) == 3
    assert _value("conveyor_prompt_tokens_total", **lab) == 10
    assert _value("conveyor_generation_tokens_total", **lab) == 4
    assert _value("conveyor_preemptions_total", **lab) == 2
    assert _value("conveyor_prefix_cache_queries_total", **lab) == 8
    assert _value("conveyor_prefix_cache_hits_total", **lab) == 6
    assert _value("conveyor_scheduled_tokens_total", kind="prefill", **lab) == 20
    assert _value("conveyor_scheduled_tokens_total", kind="decode", **lab) == 4
    assert _value("conveyor_requests_finished_total", reason="length", **lab) == 1
    em.observe_rejected("queue_full")
    assert _value("conveyor_requests_rejected_total", reason="queue_full", **lab) == 1


def test_tokens_are_timed_by_the_step_that_sampled_them_not_by_when_they_arrive() -> None:
    """Stream batching hands several steps to the listener at once: ITL must still be the steps' spacing."""
    em = m.EngineMetrics("unit-model", "r-batched")
    lab = {"model": "unit-model", "replica": "r-batched"}
    em.observe_step(EngineStepStats(step_time_s=0.01, finished_at=50.0), [_out("a", 49.9, 50.0)])
    for t in (50.02, 50.04):  # both delivered later, in one batch
        em.observe_step(EngineStepStats(step_time_s=0.01, finished_at=t), [_out("a", 49.9, 50.0)])
    assert _value("conveyor_inter_token_latency_seconds_count", **lab) == 2
    assert _value("conveyor_inter_token_latency_seconds_sum", **lab) == pytest.approx(0.04)


def test_aborted_requests_are_pruned() -> None:
    em = m.EngineMetrics("unit-model", "r-prune")
    stats = EngineStepStats(step_time_s=0.001)
    em.observe_step(stats, [_out("gone", 0.0, 1.0)], now=1.0)  # never finishes (client aborted)
    assert len(em._last_token) == 1
    for i in range(m._PRUNE_EVERY_STEPS):
        em.observe_step(stats, [], now=1.0 + m._STALE_AFTER_S + 1 + i)
    assert len(em._last_token) == 0


def test_every_family_is_exposed_with_conveyor_prefix() -> None:
    m.EngineMetrics("unit-model", "r-families")
    text = generate_latest().decode()
    for name in m.ENGINE_FAMILIES:
        assert name.startswith("conveyor_")
        assert f"{name}{{" in text or f"{name}_bucket{{" in text, name
