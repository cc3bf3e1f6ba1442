"""A wedged engine (alive, with work, but no step completing) fails its replica's health check and Serve replaces
the replica; /ready is 200 while an engine serves and 503 while none can. The time from the stall to a new replica
serving is reported (drills/wedged_engine.json under $CONVEYOR_ARTIFACTS or the temp dir)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from ray import serve

from benchmarks.soak import replica_actor_names
from tests.drills.conftest import write_artifact
from tests.router.conftest import deploy, engine_handle, wait_until

pytestmark = pytest.mark.timeout(240)

APP = "conveyor-drill-wedge"
STALL_TIMEOUT_S = 3.0
HEALTH_PERIOD_S = 1.0
STALL_S = 600.0  # far beyond the test: only the replacement ends it
DRAIN_S = 2.0  # a wedged engine finishes nothing: waiting Serve's default 20 s for it to drain only delays


def running_replicas() -> int:
    app = serve.status().applications.get(APP)
    engine = app.deployments.get("EngineReplica") if app is not None else None
    return engine.replica_states.get("RUNNING", 0) if engine is not None else 0


def test_a_wedged_engine_is_detected_and_replaced(serve_cluster: str, tiny_model_dir) -> None:
    args = {"model": str(tiny_model_dir), "served_model_name": "tiny", "num_kv_blocks": 64, "max_num_seqs": 4,
            "torch_num_threads": 1, "engine_stall_timeout_s": STALL_TIMEOUT_S,
            "health_check_period_s": HEALTH_PERIOD_S, "drain_timeout_s": DRAIN_S, "test_hooks": True}
    url = serve_cluster + "/drill-wedge"
    probes: list[tuple[int, int]] = []  # (/ready status, engine replicas RUNNING right after), while deploying

    def probe_readiness() -> None:
        try:
            status = httpx.get(url + "/ready", timeout=5).status_code
        except httpx.HTTPError:
            return  # the ingress is not listening yet
        probes.append((status, running_replicas()))

    with deploy(args, APP, "/drill-wedge", while_waiting=probe_readiness):
        ready = httpx.get(url + "/ready", timeout=30)
        assert ready.status_code == 200 and ready.json()["ready"] is True, ready.text
        # Readiness: 503 while the engine loads (the ingress is up before it), and never 200 before an engine
        # replica runs. 404: the proxy has no route to the application yet. (Whether a probe lands in the loading
        # window at all depends on the host's speed, so a 503 is not required to have been seen.)
        assert {status for status, _ in probes} <= {200, 404, 503}, probes
        assert all(num_running >= 1 for status, num_running in probes if status == 200), probes
        (victim,) = replica_actor_names(APP)
        engine_handle(APP).stall_engine_for_test.remote(STALL_S).result(timeout_s=10)
        stalled_at = time.monotonic()
        # A request arrives at the wedged engine: it has work and makes no progress.
        with ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                                timeout=120)
            wait_until(lambda: running_replicas() == 1 and any(n != victim for n in replica_actor_names(APP)),
                       120, "a new replica to replace the wedged one", 0.25)
            replaced_at = time.monotonic()
            wait_until(lambda: victim not in replica_actor_names(APP), 120, "the wedged replica to go", 0.25)
            victim_gone_at = time.monotonic()
            # Its request either failed with the replica (5xx) or, sent before any token, was retried elsewhere.
            stuck_status = stuck.result(timeout=120).status_code
        assert stuck_status == 200 or stuck_status >= 500
        wait_until(lambda: httpx.get(url + "/ready", timeout=30).status_code == 200, 60, "readiness again", 0.25)
        out = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        served_at = time.monotonic()
        assert out.status_code == 200, out.text
    write_artifact("wedged_engine", {
        "engine_stall_timeout_s": STALL_TIMEOUT_S, "health_check_period_s": HEALTH_PERIOD_S,
        "drain_timeout_s": DRAIN_S,
        "stall_to_new_replica_running_s": round(replaced_at - stalled_at, 2),
        "stall_to_wedged_replica_gone_s": round(victim_gone_at - stalled_at, 2),
        "stall_to_serving_again_s": round(served_at - stalled_at, 2),
        "stuck_request_status": stuck_status,
        "readiness_while_deploying": {str(code): sum(s == code for s, _ in probes) for code in (404, 503, 200)}})
