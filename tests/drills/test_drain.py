"""The fleet changing on purpose, under load, deployed the way `serve deploy` does it (a declarative config):

- scale-in from two engine replicas to one: the replica Serve stops finishes the streams it is generating, and what
  waits in its queue is handed back to the other replica at once, not held for the drain and not lost;
- the same past the drain limit: streams still running when it expires end with an SSE error event and [DONE], and
  the ingress counts them (conveyor_requests_cut_total);
- a rolling update (a changed engine setting restarts every replica, the ingress included): no request fails, and
  the latency during the update is reported next to the steady state (conftest.write_artifact).
"""
from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from ray import serve

from benchmarks.soak import percentile, replica_actor_names
from tests.drills.conftest import write_artifact
from tests.router.conftest import wait_until
from tests.router.streaming import Sample, StreamResult, StreamStarts, closed_loop, stream_completion

pytestmark = pytest.mark.timeout(300)

APP = "conveyor-drill-drain"
ROUTE = "/drill-drain"


@pytest.fixture
def app_args(tiny_model_dir) -> dict[str, Any]:
    return {"model": str(tiny_model_dir), "served_model_name": "tiny", "num_kv_blocks": 64, "max_num_seqs": 2,
            "torch_num_threads": 1, "num_cpus": 1,
            # every request waits its turn: the drill is about drains losing nothing, not about SLO refusals
            "admission_policy": "queue"}


@contextmanager
def declared_app(args: dict[str, Any], num_replicas: int) -> Iterator[Callable[[dict[str, Any], int], None]]:
    """Deploy as `serve deploy` would; yield apply(args, num_replicas) to change it. The replica count is a
    deployment override (a lightweight update); anything under `args` is a new version (a rolling restart)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    client = _get_global_client()

    def apply(app_args: dict[str, Any], replicas: int) -> None:
        app = {"name": APP, "route_prefix": ROUTE, "import_path": "conveyor.router.app:build_app",
               "args": app_args, "deployments": [{"name": "EngineReplica", "num_replicas": replicas}]}
        client.deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}))

    apply(args, num_replicas)
    try:
        wait_until(lambda: app_running() and len(replica_actor_names(APP)) == num_replicas, 120,
                   "the declared application to run", 0.25)
        yield apply
    finally:
        serve.delete(APP)


def app_running() -> bool:
    app = serve.status().applications.get(APP)
    return app is not None and app.status == "RUNNING"


def metric_sum(metrics_url: str, name: str) -> float:
    """One metric family's value summed over its label sets, from a Prometheus text endpoint."""
    text = httpx.get(metrics_url, timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def ingress_counter(base_url: str, name: str) -> float:
    return metric_sum(base_url + "/metrics", name)


def wait_both_routable(url: str, timeout_s: float = 30.0) -> None:
    """One-token requests until both replicas have answered one. The ingress's router learns a new deployment's
    replicas some time after the controller calls it running; streams sent before that all went to one replica
    (seen in a full suite run: 4 of 4), and the drill then waited in vain for the other to stream."""
    seen = StreamStarts()
    deadline = time.monotonic() + timeout_s
    while len(seen.counts) < 2:
        if time.monotonic() > deadline:
            raise AssertionError(f"only {dict(seen.counts)} answered within {timeout_s:.0f} s")
        stream_completion(url, "warm up", 1, seen.note, 30)


def load_until_both_busy(pool: ThreadPoolExecutor, url: str, num_requests: int, max_tokens: int,
                         min_per_replica: int = 2, close_when: threading.Event | None = None,
                         max_requests: int | None = None) -> tuple[list[Any], StreamStarts]:
    """Start the streams; return once each of the two replicas streams min_per_replica (2: a full batch). Where
    the router put more on one replica than it runs, one more stream goes out every second, up to max_requests."""
    wait_both_routable(url)
    starts = StreamStarts()

    def send(i: int) -> Any:
        return pool.submit(stream_completion, url, f"drain {i} " * 4, max_tokens, starts.note, 180, close_when)

    def both_busy(counts: Counter[str]) -> bool:
        return len(counts) == 2 and min(counts.values()) >= min_per_replica

    futures = [send(i) for i in range(num_requests)]
    deadline = time.monotonic() + 60
    while not starts.wait_for(both_busy, 1.0):
        if time.monotonic() > deadline:
            ended = [f.result() for f in futures if f.done()]
            raise AssertionError(f"the replicas never both streamed {min_per_replica}: {starts.counts}, "
                                 f"ended: {ended[:3]}")
        if len(futures) < (max_requests or num_requests):
            futures.append(send(len(futures)))
    return futures, starts


def engine_gauges(url: str, name: str) -> dict[str, float]:
    """A gauge's value on each engine replica, read from the replicas' own metrics endpoints."""
    return {target["labels"]["replica"]: metric_sum(f"http://{target['targets'][0]}/metrics", name)
            for target in httpx.get(url + "/metrics/targets", timeout=10).json()
            if target["labels"].get("conveyor_role") == "engine"}


def queue_on_both(pool: ThreadPoolExecutor, url: str, max_tokens: int, max_extra: int = 8) -> list[Any]:
    """Wait until each replica holds a queued request, sending one more stream (routed to the less loaded
    replica) every half second while one does not: whichever replica Serve stops must have something to hand
    back. Without this the drill failed ~1 run in 3: the router had queued all four spare streams on one replica
    and Serve stopped the other."""
    extra: list[Any] = []
    deadline = time.monotonic() + 60
    while True:
        waiting = engine_gauges(url, "conveyor_requests_waiting")
        if len(waiting) == 2 and min(waiting.values()) >= 1:
            return extra
        if time.monotonic() > deadline:
            raise AssertionError(f"no queue on both replicas: waiting {waiting} after {len(extra)} more streams")
        if len(extra) < max_extra:
            extra.append(pool.submit(stream_completion, url, f"queued {len(extra)} " * 4, max_tokens, None, 180))
        time.sleep(0.5)


def wait_scaled_in(before: list[str], timeout_s: float) -> tuple[str, float]:
    """The replica Serve stopped (its id as streams report it) and when its actor was gone."""
    def one_left() -> list[str] | None:
        names = replica_actor_names(APP)
        return names if len(names) == 1 else None

    names = wait_until(one_left, timeout_s, "the stopped replica to exit", 0.1)
    victim = next(n for n in before if n not in names)
    return victim.rsplit("#", 1)[-1], time.monotonic()


# The running streams: long enough that a replica's queue still waits when Serve's routing update reaches the
# ingress (with 400-token streams, well under a second each on a 2-core Zen 5, a busy full suite run once found
# nothing to hand back). The queued ones need only wait behind them: short, so the drill does not spend minutes
# generating them on one replica afterwards (~60 s on a 2-core Zen 3 when they were as long).
SCALE_IN_STREAM_TOKENS = 4000
QUEUED_STREAM_TOKENS = 16


def test_scale_in_finishes_running_streams_and_hands_back_the_queue(serve_cluster: str, app_args,
                                                                    long_context_model_dir) -> None:
    args = app_args | {"model": str(long_context_model_dir), "num_kv_blocks": 600, "drain_timeout_s": 60}
    url = serve_cluster + ROUTE
    with declared_app(args, 2) as apply, ThreadPoolExecutor(16) as pool:
        running, _ = load_until_both_busy(pool, url, 4, SCALE_IN_STREAM_TOKENS, max_requests=8)
        queued = queue_on_both(pool, url, QUEUED_STREAM_TOKENS)
        before = replica_actor_names(APP)
        scaled_at = time.monotonic()
        apply(args, 1)
        victim_id, gone_at = wait_scaled_in(before, 120)
        results: list[StreamResult] = [f.result(timeout=180) for f in running + queued]
        expected_tokens = [SCALE_IN_STREAM_TOKENS] * len(running) + [QUEUED_STREAM_TOKENS] * len(queued)
        handed_back = ingress_counter(url, "conveyor_requests_handed_back_total")
        cut_counted = ingress_counter(url, "conveyor_requests_cut_total")
    # Every request completes: the running ones on the stopped replica within its drain time, the queued ones
    # handed to the other replica.
    assert all(r.status == 200 and r.done and r.error is None for r in results), \
        [(r.status, r.error) for r in results if r.error is not None or not r.done]
    assert [(r.finish_reason, r.tokens) for r in results] == [("length", n) for n in expected_tokens]
    finished_on_victim = sum(r.replica == victim_id for r in results[:len(running)])
    assert finished_on_victim >= 2  # the full batch it was streaming when told to stop
    by_replica = {replica: sum(r.replica == replica for r in results) for replica in {r.replica for r in results}}
    assert handed_back >= 1 and cut_counted == 0, (handed_back, cut_counted, victim_id, by_replica)
    report = {"requests": len(results), "running_streams": len(running), "queued_streams": len(queued),
              "finished_on_stopped_replica": finished_on_victim,
              "handed_back": handed_back, "stopped_replica_exit_s": round(gone_at - scaled_at, 2),
              "drain_timeout_s": 60}
    write_artifact("drain_scale_in", report)


LONG_STREAM_TOKENS = 16_000


@pytest.fixture(scope="module")
def long_context_model_dir(tmp_path_factory):
    # Streams that outlast a 2 s drain on any CPU we know: the tiny model writes 2000 tokens in well under 2 s on
    # a 2-core Zen 5 (the drill then cut nothing), 16 000 take several seconds there.
    from tests.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-16k"), max_position_embeddings=16384)


def test_streams_past_the_drain_limit_end_with_an_error_event_and_are_counted(serve_cluster: str, app_args,
                                                                              long_context_model_dir) -> None:
    args = app_args | {"model": str(long_context_model_dir), "num_kv_blocks": 2100, "drain_timeout_s": 2}
    url = serve_cluster + ROUTE
    hang_up = threading.Event()
    with declared_app(args, 2) as apply, ThreadPoolExecutor(4) as pool:
        futures, starts = load_until_both_busy(pool, url, 4, LONG_STREAM_TOKENS, min_per_replica=1,
                                               close_when=hang_up)
        before = replica_actor_names(APP)
        scaled_at = time.monotonic()
        apply(args, 1)
        victim_id, gone_at = wait_scaled_in(before, 60)
        # Every stream the stopped replica started has ended (cut). The other replica's streams would run for
        # minutes more on a slow CPU: their clients hang up now, which must not count as a cut.
        wait_until(lambda: sum(f.done() and f.result().replica == victim_id for f in futures)
                   >= starts.counts[victim_id], 60, "the stopped replica's streams to end")
        hang_up.set()
        results = [f.result(timeout=60) for f in futures]
        cut_counted = ingress_counter(url, "conveyor_requests_cut_total")
    cut = [r for r in results if r.error is not None]
    others = [r for r in results if r.error is None]
    assert all(r.status == 200 for r in results), [(r.status, r.error) for r in results]
    # Cut: only what the stopped replica was streaming (its batch, or two if slots turned over meanwhile), each
    # with an error event and then [DONE].
    assert 1 <= len(cut) <= 4, [(r.replica, r.chunks) for r in cut]
    assert all(r.replica == victim_id and r.chunks >= 1 and r.done and not r.closed_early for r in cut)
    # The rest streamed on the other replica until their clients hung up (or, on a fast CPU, to their end).
    assert all(r.replica != victim_id and r.chunks >= 1 for r in others), [(r.replica, r.chunks) for r in others]
    assert all(r.closed_early or (r.done and r.finish_reason == "length" and r.tokens == LONG_STREAM_TOKENS)
               for r in others)
    assert cut_counted == len(cut)
    write_artifact("drain_past_limit", {"requests": len(results), "cut_streams": len(cut),
                                        "cut_counted": cut_counted, "drain_timeout_s": 2,
                                        "stopped_replica_exit_s": round(gone_at - scaled_at, 2)})


def test_rolling_update_under_load_fails_no_request(serve_cluster: str, app_args) -> None:
    args = app_args | {"drain_timeout_s": 30}
    url = serve_cluster + ROUTE
    samples: list[Sample] = []
    stop = threading.Event()
    with declared_app(args, 2) as apply, ThreadPoolExecutor(4) as pool:
        before = replica_actor_names(APP)
        futures = [pool.submit(closed_loop, url, stop, samples, c, 40) for c in range(4)]
        time.sleep(4.0)  # steady state
        update_at = time.monotonic()
        apply(args | {"max_num_seqs": 3}, 2)  # a changed engine setting: every replica is replaced
        wait_until(lambda: app_running() and len(names := replica_actor_names(APP)) == 2
                   and not set(names) & set(before), 180, "the rolling update to finish", 0.25)
        updated_at = time.monotonic()
        time.sleep(3.0)  # the new replicas take the load
        stop.set()
        for f in futures:
            f.result(timeout=120)
        after = replica_actor_names(APP)
        targets = httpx.get(url + "/metrics/targets", timeout=10).json()
    failed = [s.result for s in samples if s.result.status != 200 or not s.result.done or s.result.error is not None]
    assert not failed, [(r.status, r.error) for r in failed]
    assert all(s.result.finish_reason == "length" and s.result.tokens == 40 for s in samples)
    new_ids = {n.rsplit("#", 1)[-1] for n in after}
    assert any(s.result.replica in new_ids for s in samples if s.start >= updated_at)
    # Prometheus follows the change: service discovery lists the new engine replicas, not the old ones.
    engines = {t["labels"].get("replica") for t in targets if t["labels"].get("conveyor_role") == "engine"}
    assert engines == new_ids, (engines, new_ids)
    steady = [s.end - s.start for s in samples if s.end < update_at]
    during = [s.end - s.start for s in samples if s.end >= update_at and s.start <= updated_at]
    report = {"requests": len(samples), "failed": len(failed), "update_s": round(updated_at - update_at, 2),
              "steady_requests": len(steady), "steady_p50_s": round(percentile(steady, 0.5), 3),
              "steady_p99_s": round(percentile(steady, 0.99), 3),
              "update_requests": len(during), "update_p50_s": round(percentile(during, 0.5), 3),
              "update_p99_s": round(percentile(during, 0.99), 3)}
    write_artifact("rolling_update", report)
    assert len(steady) >= 5 and len(during) >= 5, report
