"""Overload: offered load at ~3x capacity against one replica with small queue bounds.

Admitted requests keep their tail latency near the unloaded one (the waiting queue is bounded, and the engine sheds
a request whose expected wait for a batch slot exceeds max_queue_wait_s, so nobody waits behind a backlog), the
rest get 429 fast, the engine's waiting queue never exceeds its bound, and
every block is free afterwards.
"""
from __future__ import annotations

import asyncio
import os
import random
import threading
import time

import httpx
import pytest
import ray

from benchmarks.soak import percentile
from tests.drills.conftest import write_artifact
from tests.router.conftest import deploy, engine_state, wait_until

pytestmark = pytest.mark.timeout(180)

APP = "conveyor-drill-overload"
MAX_NUM_SEQS = 4
# Half a batch: under saturation the running sequences finish staggered (one every ~S/4 for a service time S),
# so an admitted request waits about S/2 before it joins the batch; its E2E is then ~1.5x the unloaded one.
MAX_WAITING = 2
# About half the unloaded service time of a request here (~0.5-0.8 s): an admitted request waits at most ~S/2 for
# its slot, so its latency stays well inside 2x the unloaded one even when the batch's finishes bunch together.
MAX_QUEUE_WAIT_S = 0.3
# Long enough that a request costs the engine far more than the HTTP stack (~20 ms of CPU per request over the
# proxy, ingress and replica): with 96 tokens the tiny model served ~30 req/s, and 3x that on two shared cores
# measured Ray Serve's HTTP throughput rather than our admission control. A real model's replica serves a few.
BODY = {"prompt": "overload drill prompt", "max_tokens": 384, "ignore_eos": True}
OVERLOAD_FACTOR = 3.0
OVERLOAD_S = 8.0
# Timing targets (admitted p99 within 2x of unloaded, 429s within ~1 s) are benchmark figures, printed and written
# to drills/overload.json (conftest.write_artifact); a test on a shared 2-core host only asserts what cannot flake: a
# refusal never hangs (well under the admitted requests' latency), the queue stays bounded, nothing leaks.
NO_HANG_429_S = 5.0


@pytest.fixture(scope="module")
def base_url(serve_cluster: str, tiny_model_dir):
    args = {"model": str(tiny_model_dir), "served_model_name": "tiny", "num_kv_blocks": 128,
            "max_num_seqs": MAX_NUM_SEQS, "max_waiting_requests": MAX_WAITING, "torch_num_threads": 1,
            "max_queue_wait_s": MAX_QUEUE_WAIT_S,
            "request_router_class": None}
    with deploy(args, APP, "/drill-overload"):
        yield serve_cluster + "/drill-overload"


async def _timed_post(client: httpx.AsyncClient, url: str) -> tuple[int, float]:
    start = time.perf_counter()
    resp = await client.post(url + "/v1/completions", json=BODY)
    if resp.status_code == 200:
        assert resp.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
    return resp.status_code, time.perf_counter() - start


async def unloaded(url: str, rounds: int = 8) -> list[float]:
    """Full batches (MAX_NUM_SEQS at a time), nothing queued: the service time at capacity."""
    latencies: list[float] = []
    async def staggered(k: int) -> tuple[int, float]:
        # Admission counts requests the engine thread has not scheduled yet as waiting, even with batch slots
        # free: a burst of MAX_NUM_SEQS > MAX_WAITING can get 429s. Space the arrivals, and retry the rare 429
        # (a slow engine step on this busy host) so the baseline is a full batch's service time.
        await asyncio.sleep(0.05 * k)
        for _ in range(5):
            status, latency = await _timed_post(client, url)
            if status != 429:
                break
            await asyncio.sleep(0.1)
        return status, latency

    async with httpx.AsyncClient(timeout=60) as client:
        for _ in range(rounds):
            results = await asyncio.gather(*(staggered(k) for k in range(MAX_NUM_SEQS)))
            assert all(status == 200 for status, _ in results), results
            latencies += [t for _, t in results]
    return latencies


async def open_loop(url: str, rate_per_s: float, duration_s: float) -> list[tuple[int, float]]:
    """Poisson arrivals at `rate_per_s` for `duration_s`, whatever the answers (an open-loop overload)."""
    rng = random.Random(0)
    tasks: list[asyncio.Task[tuple[int, float]]] = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        end = time.perf_counter() + duration_s
        while time.perf_counter() < end:
            tasks.append(asyncio.create_task(_timed_post(client, url)))
            await asyncio.sleep(rng.expovariate(rate_per_s))
        return list(await asyncio.gather(*tasks))


def as_client(coro_fn, *args):
    """Run a load coroutine on its own thread at the niceness of Ray's workers (the server side).

    Ray starts its workers at nice 15 (RAY_worker_niceness); this test process is at 0, so a load generator run
    here would preempt the engine whenever it is runnable: 28x the CPU weight. A real client runs on another
    machine; on one shared 2-core host the fair stand-in is a client that competes with the server as an equal.
    """
    worker_niceness = ray.get(_niceness.remote())
    box: list = []

    def run() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), worker_niceness)  # this thread only
        box.append(asyncio.run(coro_fn(*args)))

    thread = threading.Thread(target=run, name="drill-client")
    thread.start()
    thread.join()
    return box[0]


@ray.remote(num_cpus=0)
def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def watch_queue(stop: threading.Event, peaks: dict[str, int]) -> None:
    while not stop.wait(0.1):
        state = engine_state(APP)
        for key in ("num_waiting", "num_running"):
            peaks[key] = max(peaks.get(key, 0), state[key])


def engine_step_totals() -> tuple[float, float]:
    """(seconds, steps) the engine has stepped so far, from its Prometheus endpoint."""
    from conveyor.router.metrics_registry import live_targets

    targets = live_targets(APP)
    address = next(t["targets"][0] for t in targets if t["labels"].get("conveyor_role") == "engine")
    totals = {"sum": 0.0, "count": 0.0}
    for line in httpx.get(f"http://{address}/metrics", timeout=10).text.splitlines():
        for key in totals:
            if line.startswith(f"conveyor_step_duration_seconds_{key}"):
                totals[key] += float(line.split()[-1])
    return totals["sum"], totals["count"]


def mean_step_ms(before: tuple[float, float], after: tuple[float, float]) -> float:
    return round(1000 * (after[0] - before[0]) / max(1.0, after[1] - before[1]), 2)


def test_overload_keeps_admitted_latency_and_rejects_fast(base_url: str) -> None:
    as_client(unloaded, base_url, 2)  # warm-up
    steps_0 = engine_step_totals()
    base = as_client(unloaded, base_url)
    steps_1 = engine_step_totals()
    base_p99 = percentile(base, 0.99)
    capacity_per_s = MAX_NUM_SEQS / percentile(base, 0.5)
    peaks: dict[str, int] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch_queue, args=(stop, peaks), daemon=True)
    watcher.start()
    try:
        results = as_client(open_loop, base_url, OVERLOAD_FACTOR * capacity_per_s, OVERLOAD_S)
    finally:
        stop.set()
        watcher.join(timeout=10)
    steps_2 = engine_step_totals()
    # The host is shared: if it got busier during the overload, the baseline taken before understates the
    # service time. Measure it again after and compare against the slower of the two.
    base_after = as_client(unloaded, base_url)
    base_p99 = max(base_p99, percentile(base_after, 0.99))
    admitted = [t for status, t in results if status == 200]
    rejected = [t for status, t in results if status == 429]
    report = {"unloaded_p50_s": round(percentile(base, 0.5), 3),
              "unloaded_p99_before_after_s": [round(percentile(base, 0.99), 3),
                                              round(percentile(base_after, 0.99), 3)],
              "capacity_req_per_s": round(capacity_per_s, 2), "offered": len(results),
              "offered_req_per_s": round(len(results) / OVERLOAD_S, 2), "admitted": len(admitted),
              "rejected_429": len(rejected), "admitted_p50_s": round(percentile(admitted, 0.5), 3),
              "admitted_p99_s": round(percentile(admitted, 0.99), 3),
              "p99_ratio": round(percentile(admitted, 0.99) / base_p99, 2),
              "rejected_p99_s": round(percentile(rejected, 0.99), 3), "rejected_max_s": round(max(rejected), 3),
              "peak_num_waiting": peaks.get("num_waiting"), "peak_num_running": peaks.get("num_running"),
              # Where admitted latency goes: the engine's own step, unloaded vs overloaded (CPU contention).
              "engine_step_ms_unloaded_overload": [mean_step_ms(steps_0, steps_1), mean_step_ms(steps_1, steps_2)]}
    write_artifact("overload", report)

    assert {status for status, _ in results} <= {200, 429}, sorted({s for s, _ in results})
    assert len(rejected) >= len(results) // 3, report  # 3x capacity: most of the excess is refused
    assert max(rejected) < NO_HANG_429_S, report
    # The queue bound is the waiting bound plus free batch slots (requests at an idle engine wait one step for
    # a slot that is already theirs), so waiting never exceeds MAX_WAITING + MAX_NUM_SEQS.
    assert peaks.get("num_waiting", 0) <= MAX_WAITING + MAX_NUM_SEQS, peaks
    assert peaks.get("num_running", 0) <= MAX_NUM_SEQS, peaks
    state = wait_until(lambda: (s := engine_state(APP))["num_block_tables"] == 0 and s, 15, "idle engine")
    assert state["num_free_blocks"] == state["num_blocks"]
