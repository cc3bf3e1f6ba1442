"""Autoscaling end to end with the tiny model: 1 replica at rest, more under a load beyond the queue target,
back to 1 once the load stops. The timeline (replicas and client-side p99 over time) is kept as an artifact
(JSON + PNG) under $CONVEYOR_ARTIFACTS, else under the system's temp dir (conveyor-artifacts/)."""
from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.autoscale_ramp import Load, ReplicaWatcher, Timeline, plot
from tests.metrics.conftest import deploy, wait_for

APP, PREFIX, MODEL = "metrics-autoscale", "/metrics-autoscale", "tiny-autoscale"
# Never a tracked path: a test run must leave the checkout clean.
ARTIFACTS = Path(os.environ.get("CONVEYOR_ARTIFACTS") or Path(tempfile.gettempdir()) / "conveyor-artifacts")
AUTOSCALING = {"min_replicas": 1, "max_replicas": 3, "target_queue_per_replica": 2,
               # generous SLOs: this test drives scaling by queue depth (the tiny model is fast)
               "ttft_p99_slo_s": 30.0, "itl_p99_slo_s": 5.0,
               "upscale_delay_s": 0.5, "downscale_delay_s": 3.0, "scale_in_sustain_s": 3.0,
               "metrics_interval_s": 0.5, "look_back_period_s": 1.0}


@pytest.fixture(scope="module")
def base_url(metrics_cluster: str, tiny_model_dir) -> Iterator[str]:  # noqa: ANN001
    # max_num_seqs 2: a handful of clients is enough to build a queue on one replica.
    args = {"model": str(tiny_model_dir), "served_model_name": MODEL, "num_kv_blocks": 128, "max_num_seqs": 2,
            "torch_num_threads": 1, "num_cpus": 1, "autoscaling": AUTOSCALING,
            "admission_policy": "queue"}  # a queue, not SLO refusals, is the signal this test scales on
    with deploy(args, APP, PREFIX):
        yield metrics_cluster + PREFIX


def test_scales_out_under_load_and_back_to_min(base_url: str) -> None:
    tl = Timeline()
    watcher = ReplicaWatcher(APP, tl, every_s=0.5)
    load = Load(base_url, MODEL, tl, max_tokens=48, max_clients=12)
    initial: set[str] = set()
    try:
        wait_for(lambda: watcher.running() == 1, 20, "one replica at rest")
        time.sleep(2)
        assert watcher.running() == 1
        tl.mark("step")
        load.concurrency = 12  # 12 clients vs 2 running per replica: ~10 waiting, target 2 per replica
        # The policy's decision (a second replica asked for) must come fast; the replica's start is paced by the
        # machine: at Ray's worker priority (nice 15) beside a busy engine it took 58 s on a 2-core Zen 3 (session
        # 17); it now starts at the engine's niceness (serving/priority.py), and 180 s stays a bound, not a target.
        wait_for(lambda: watcher.total() >= 2, 60, "a second replica asked for under load")
        tl.mark("scale-out decided")
        wait_for(lambda: watcher.running() >= 2, 180, "the second replica running")
        tl.mark("scaled out")
        # Keep the load until the added capacity serves traffic (or max is reached), at most 30 s more.
        # The replica that served before the step (and anything that started in its first second).
        initial = {s.replica for s in tl.samples if s.replica and s.start < tl.events["step"] + 1}
        try:
            wait_for(lambda: tl.first_new_replica_served(tl.events["step"], initial) is not None, 30,
                     "a request served by an added replica")
        finally:
            tl.mark("load stops")
            load.stop()
        wait_for(lambda: watcher.running() == 1 and tl.replicas[-1][2] == 1, 90, "scale back in to 1")
        tl.mark("back to min")
    finally:
        load.stop()
        watcher.stop()
        _save(tl, initial)
    peak = max(r[1] for r in tl.replicas)
    assert peak >= 2
    assert sum(1 for s in tl.samples if not s.ok) == 0


def _save(tl: Timeline, initial: set[str]) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    data = tl.to_json()
    step = tl.events.get("step")
    served = tl.first_new_replica_served(step, initial) if step is not None else None
    data["summary"] = {
        "scale_out_decided_after_s": (tl.events["scale-out decided"] - step)
        if "scale-out decided" in tl.events else None,
        "scaled_out_after_s": (tl.events["scaled out"] - step) if "scaled out" in tl.events else None,
        "added_replica_serving_after_s": (served - step) if served is not None else None,
        "back_to_min_after_load_stop_s": (tl.events["back to min"] - tl.events["load stops"])
        if "back to min" in tl.events else None,
        "peak_replicas": max((r[1] for r in tl.replicas), default=0), "requests": len(tl.samples),
        "config": AUTOSCALING}
    (ARTIFACTS / "autoscale_e2e.json").write_text(json.dumps(data, indent=1))
    plot({"autoscaling": tl}, ARTIFACTS / "autoscale_e2e.png", "Autoscaling e2e (tiny model)")
    print("autoscaling timeline:", json.dumps(data["summary"]))
