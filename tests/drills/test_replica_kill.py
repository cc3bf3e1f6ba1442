"""Replica kill under sustained load, beyond tests/router/test_replicas.py (which checks that nothing is lost that
had not started streaming): here the fleet must return to full strength (two RUNNING replicas, one of them new,
serving traffic) within a deadline, and the latency of requests during the recovery window is reported next to
the steady-state latency (drills/replica_kill.json: conftest.write_artifact)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from ray import serve

from benchmarks.soak import is_idle, percentile, replica_actor_names, wait_fleet_idle
from tests.drills.conftest import write_artifact
from tests.router.conftest import deploy, wait_until
from tests.router.streaming import Sample, closed_loop

pytestmark = pytest.mark.timeout(240)

APP = "conveyor-drill-kill"
RECOVERY_TIMEOUT_S = 90.0
CLIENTS = 6


@pytest.fixture(scope="module")
def base_url(serve_cluster: str, tiny_model_dir):
    args = {"model": str(tiny_model_dir), "served_model_name": "tiny", "num_replicas": 2, "num_kv_blocks": 64,
            "max_num_seqs": 2, "torch_num_threads": 1, "num_cpus": 1,
            "admission_policy": "queue"}  # the drill counts lost requests; a refusal under load is not one
    with deploy(args, APP, "/drill-kill"):
        yield serve_cluster + "/drill-kill"


def running_replicas() -> int:
    deployment = serve.status().applications[APP].deployments["EngineReplica"]
    return deployment.replica_states.get("RUNNING", 0)


def test_fleet_recovers_after_replica_kill(base_url: str) -> None:
    before = replica_actor_names(APP)
    assert len(before) == 2 and running_replicas() == 2
    samples: list[Sample] = []
    stop = threading.Event()
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(closed_loop, base_url, stop, samples, c, 30) for c in range(CLIENTS)]
        time.sleep(4.0)  # steady state on two replicas
        victim = before[0]
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        # Full strength: two RUNNING replicas again, the victim replaced by a new one.
        wait_until(lambda: running_replicas() == 2 and victim not in (names := replica_actor_names(APP))
                   and len(names) == 2, RECOVERY_TIMEOUT_S, "the fleet to return to two replicas", 0.2)
        recovered_at = time.monotonic()
        new_id = next(n for n in replica_actor_names(APP) if n not in before).rsplit("#", 1)[-1]
        # The load stays on until the new replica takes traffic: within seconds, but a busy machine can hold the
        # ingress's view of the new replica back past a fixed 3 s (seen once in a full suite run).
        time.sleep(3.0)
        wait_until(lambda: any(s.result.replica == new_id for s in list(samples) if s.start >= recovered_at),
                   30, "the new replica to serve a request", 0.2)
        stop.set()
        for f in futures:
            f.result(timeout=120)
    victim_id = victim.rsplit("#", 1)[-1]

    # Nothing lost but streams already running on the victim (each said so with an SSE error, then [DONE]).
    assert all(s.result.status == 200 and s.result.done for s in samples), \
        [(s.result.status, s.result.error) for s in samples if s.result.status != 200 or not s.result.done]
    cut = [s for s in samples if s.result.error is not None]
    assert all(s.result.replica == victim_id and s.result.chunks >= 1 for s in cut)
    assert len(cut) <= 4  # its batch (2), twice if both slots turned over just before the kill
    # The new replica serves.
    assert any(s.result.replica == new_id for s in samples if s.start >= recovered_at)

    ok = [s for s in samples if s.result.error is None]
    steady = [s.end - s.start for s in ok if s.end < killed_at]
    window = [s.end - s.start for s in ok if s.end >= killed_at and s.start <= recovered_at]
    report = {"recovery_s": round(recovered_at - killed_at, 2), "requests": len(samples), "cut_streams": len(cut),
              "steady_p50_s": round(percentile(steady, 0.5), 3), "steady_p99_s": round(percentile(steady, 0.99), 3),
              "recovery_window_requests": len(window), "recovery_p50_s": round(percentile(window, 0.5), 3),
              "recovery_p99_s": round(percentile(window, 0.99), 3),
              "served_by_new_replica": sum(s.result.replica == new_id for s in samples),
              # how long a client of a cut stream waited for its error event (a figure, not a limit)
              "cut_streams_ended_s": round(max((s.end - killed_at for s in cut), default=0.0), 2)}
    write_artifact("replica_kill", report)
    assert len(steady) >= 5 and len(window) >= 5, report
    stats = wait_fleet_idle(APP, 30)
    assert all(is_idle(s) for s in stats.values()), stats
