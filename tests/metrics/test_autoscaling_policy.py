"""The autoscaling decision on synthetic inputs, and the Serve-facing wrapper on synthetic contexts."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from conveyor.router.autoscaling import (
    STATE_CALM_SINCE,
    STATE_LAST_REASON,
    PolicyInputs,
    PolicyParams,
    QueueAndLatencyPolicy,
    decide,
)
from conveyor.router.latency_window import LatencyWindow

P = PolicyParams(target_queue_per_replica=4, ttft_p99_slo_s=1.0, itl_p99_slo_s=0.1, min_replicas=1,
                 max_replicas=6, scale_in_ratio=0.5, scale_in_sustain_s=10.0)
TICK = 0.1  # the ServeController calls the policy about every 0.1 s


def simulate(load: list[float], params: PolicyParams = P, ttft: list[float] | None = None,
             start_replicas: int = 1) -> list[int]:
    """A crude plant: `load` waiting requests spread over the replicas; capacity arrives at once."""
    replicas, state, history = start_replicas, {}, []
    for i, waiting in enumerate(load):
        t = ttft[i] if ttft else 0.2
        inputs = PolicyInputs(now=i * TICK, current_replicas=replicas, target_replicas=replicas,
                              num_waiting=waiting, num_running=replicas * 2 if waiting else 0,
                              ttft_p99_s=t, itl_p99_s=0.02)
        replicas, state = decide(inputs, state, params)
        history.append(replicas)
    return history


def test_burst_scales_out_proportionally_but_at_most_doubling() -> None:
    out = simulate([40.0] * 3)  # 40 waiting vs 4 per replica: wants 10, capped by doubling, then max
    assert out == [2, 4, 6]


def test_steady_load_in_band_holds() -> None:
    # 3 waiting per replica on 2 replicas: under target (4) but not comfortably (< 2): no change.
    assert set(simulate([6.0] * 500, start_replicas=2)) == {2}


def test_idle_scales_in_one_at_a_time_after_sustained_calm() -> None:
    out = simulate([0.0] * 400, start_replicas=4)  # 40 s of nothing
    changes = [i for i in range(1, len(out)) if out[i] != out[i - 1]]
    assert out[-1] == 1 and sorted(set(out), reverse=True) == [4, 3, 2, 1]
    gaps = [b - a for a, b in zip([0] + changes[:-1], changes, strict=True)]
    assert all(g * TICK >= P.scale_in_sustain_s - TICK for g in gaps), gaps


def test_idle_ignores_stale_latency() -> None:
    # p99 from a minute ago is over the SLO, but nothing is running: scale in anyway.
    out = simulate([0.0] * 300, ttft=[5.0] * 300, start_replicas=3)
    assert out[-1] == 1


def test_latency_breach_alone_scales_out() -> None:
    out = simulate([1.0] * 5, ttft=[2.5] * 5)
    assert out[0] == 2 and max(out) == 6  # one more per tick (the plant never improves latency)


def test_flapping_input_never_scales_in() -> None:
    # The queue alternates between breaching and empty every tick for a minute: the fleet grows to cover the
    # peaks and never shrinks, because calm is never sustained.
    load = [12.0 if i % 2 == 0 else 0.0 for i in range(600)]
    out = simulate(load, start_replicas=1)
    assert all(b >= a for a, b in zip(out[:-1], out[1:], strict=True))
    assert out[-1] == 3
    changes = sum(1 for a, b in zip(out[:-1], out[1:], strict=True) if a != b)
    assert changes <= 2


def test_slow_oscillation_scales_in_only_when_calm_lasts() -> None:
    # 5 s busy / 5 s idle: calm never lasts 10 s, so no scale-in; then a long idle period scales in.
    load = ([12.0] * 50 + [0.0] * 50) * 4 + [0.0] * 400
    out = simulate(load)
    assert max(out[:400]) == min(out[50:400]) == 3
    assert out[-1] == 1


def test_scale_in_refuses_when_fewer_replicas_would_breach() -> None:
    # 2 replicas, 3 waiting: comfortably under (0.375 < 0.5) but with 1 replica it would be 0.75: hold.
    assert set(simulate([3.0] * 300, start_replicas=2)) == {2}


def test_respects_min_and_max() -> None:
    p = PolicyParams(target_queue_per_replica=1, min_replicas=2, max_replicas=3)
    assert set(simulate([100.0] * 20, params=p, start_replicas=2)) == {3}
    assert simulate([0.0] * 300, params=p, start_replicas=3)[-1] == 2


def test_holds_target_while_scale_out_is_in_progress() -> None:
    # Serve already targets 4 but only 2 run: the policy must not return less than 4 (that would start
    # Serve's scale-in timer while replicas are still starting).
    inputs = PolicyInputs(now=0, current_replicas=2, target_replicas=4, num_waiting=9, num_running=4)
    assert decide(inputs, {}, P)[0] == 4
    calm = PolicyInputs(now=0, current_replicas=2, target_replicas=4, num_waiting=0, num_running=0)
    target, state = decide(calm, {}, P)
    assert target == 4 and state[STATE_CALM_SINCE] is None


def test_refusals_alone_scale_out_and_hold_scale_in() -> None:
    """Past capacity TTFT admission keeps the queue short and the admitted TTFT under the SLO: the share of
    requests refused is then the only sign of the demand turned away."""
    def inputs(refused: float, now: float = 0.0) -> PolicyInputs:
        return PolicyInputs(now=now, current_replicas=2, target_replicas=2, num_waiting=1, num_running=8,
                            ttft_p99_s=0.4, itl_p99_s=0.02, refused_fraction=refused)

    target, state = decide(inputs(0.25), {}, P)
    assert target == 3 and state[STATE_LAST_REASON] == "refused"
    assert decide(inputs(0.04), {}, P)[0] == 2  # under max_refused_fraction (5%): no scale-out
    state = {}
    for i in range(200):  # 20 s at 4% refused: above scale_in_ratio x 5%, so never comfortable
        target, state = decide(inputs(0.04, now=i * TICK), state, P)
        assert target == 2


def test_refused_share_over_a_sliding_window() -> None:
    window = LatencyWindow(window_s=10.0)
    assert window.mean(now=0.0) == 0.0
    for t, refused in ((0.0, 1.0), (1.0, 1.0), (5.0, 0.0), (9.0, 0.0)):
        window.add(refused, now=t)
    assert window.mean(now=9.5) == 0.5
    assert window.mean(now=11.5) == 0.0  # the two refusals have left the window
    assert window.percentile(0.99, now=11.5) == 0.0


def _ctx(current: int, waiting: dict[str, float], ttft: dict[str, float], state: dict | None = None,
         refused: dict[str, float] | None = None):
    metrics = {"num_waiting": waiting, "num_running": {k: 1.0 for k in waiting}, "ttft_p99_s": ttft,
               "itl_p99_s": {k: 0.01 for k in waiting}, "kv_cache_usage": {k: 0.1 for k in waiting},
               "refused_fraction": refused or {}}
    return SimpleNamespace(config=SimpleNamespace(min_replicas=1, max_replicas=5),
                           current_num_replicas=current, target_num_replicas=current,
                           aggregated_metrics=metrics, total_queued_requests=0,
                           policy_state=state or {}, current_time=1000.0, app_name="unit")


def test_policy_reads_serve_context() -> None:
    policy = QueueAndLatencyPolicy(target_queue_per_replica=2, ttft_p99_slo_s=1.0, itl_p99_slo_s=0.5,
                                   report_to_registry=False)
    target, _ = policy(_ctx(2, {"a": 5.0, "b": 4.0}, {"a": 0.1, "b": 0.2}))
    assert target == 4  # 9 waiting / 2 per replica -> 5, capped at doubling
    target, _ = policy(_ctx(2, {"a": 0.0, "b": 1.0}, {"a": 0.1, "b": 1.5}))  # one replica's p99 breaches
    assert target == 3
    target, _ = policy(_ctx(2, {"a": 0.0, "b": 1.0}, {"a": 0.1, "b": 0.2}, refused={"a": 0.0, "b": 0.3}))
    assert target == 3  # one replica refuses 30% of its arrivals
    inputs = policy.inputs_from_context(_ctx(1, {}, {}))
    assert inputs.ttft_p99_s is None and inputs.num_waiting == 0 and inputs.refused_fraction == 0.0


def test_with_serves_own_wrapper_delays_and_startup_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy inside Serve's real wrapper (scaling factors, up/down delays, which must see the same
    answer for downscale_delay_s), with replicas that take 2 s to start: burst, then idle, back to min."""
    from ray.serve import autoscaling_policy as ap
    from ray.serve.config import AutoscalingConfig

    clock = [1000.0]
    monkeypatch.setattr(ap.time, "time", lambda: clock[0])
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=0.5, downscale_delay_s=3.0)
    policy = ap._apply_autoscaling_config(QueueAndLatencyPolicy(
        target_queue_per_replica=2, scale_in_sustain_s=3.0, report_to_registry=False))
    running, target, state, starting = 1, 1, {}, []  # starting: (ready_at, count)
    history = []
    for tick in range(600):  # 60 s
        clock[0] += TICK
        waiting = 12.0 if 20 <= tick < 200 else 0.0  # burst from 2 s to 20 s
        metrics = {"num_waiting": {"r": waiting}, "num_running": {"r": 2.0 if waiting else 0.0},
                   "ttft_p99_s": {"r": 0.5}, "itl_p99_s": {"r": 0.01}}
        ctx = SimpleNamespace(config=config, current_num_replicas=running, target_num_replicas=target,
                              total_num_requests=waiting, aggregated_metrics=metrics, total_queued_requests=0,
                              policy_state=state, current_time=clock[0], app_name="unit")
        decision, state = policy(ctx)
        decision = max(1, min(4, decision))
        if decision > target:
            starting.append((clock[0] + 2.0, decision - target))
        elif decision < target:
            running = decision  # stopping is immediate for the count Serve reports
        target = decision
        running += sum(n for at, n in starting if at <= clock[0])
        starting = [(at, n) for at, n in starting if at > clock[0]]
        running = min(running, target)
        history.append((round(clock[0] - 1000.0, 1), running, target))
    peak = max(t for _, _, t in history)
    assert peak == 4  # 12 waiting / 2 per replica wants 6, capped at max
    targets = [t for _, _, t in history]
    assert all(b >= a for a, b in zip(targets[:200], targets[1:201], strict=True))  # no dip during the burst
    assert history[-1][1:] == (1, 1)  # back to min well within 40 s of idle
    scale_ins = [h for h, nxt in zip(history, history[1:], strict=False) if nxt[2] < h[2]]
    assert len(scale_ins) == 3  # 4 -> 3 -> 2 -> 1, one at a time


def test_fleet_reports_pause_after_a_failure_and_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed put (the GCS restarting) pauses reporting for retry_after_s, then reporting resumes; before, the
    first failure stopped it for the controller's lifetime."""
    from conveyor.router import autoscaling, metrics_registry

    sent, failing, now = [], [True], [100.0]

    def report_fleet(app: str, current: int, target: int, desired: int) -> None:
        if failing[0]:
            raise ConnectionError("GCS unavailable")
        sent.append((app, current, target))

    monkeypatch.setattr(metrics_registry, "report_fleet", report_fleet)
    reporter = autoscaling._FleetReporter(every_s=2.0, retry_after_s=30.0, clock=lambda: now[0])
    reporter.report("app", 1, 2, 2)  # fails
    failing[0] = False
    now[0] += 10
    reporter.report("app", 1, 2, 2)  # within the pause: not tried
    assert sent == []
    now[0] += 25
    reporter.report("app", 1, 2, 2)
    assert sent == [("app", 1, 2)]
    now[0] += 1
    reporter.report("app", 1, 2, 2)  # unchanged and within every_s: not sent again
    reporter.report("app", 2, 2, 2)  # changed: sent at once
    assert sent == [("app", 1, 2), ("app", 2, 2)]
