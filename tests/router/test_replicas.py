"""Two engine replicas behind the ingress: both serve, and killing one under load loses no request that had
not started streaming (those are retried on the other); streams cut mid-way end with an SSE error event."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from tests.router.conftest import deploy
from tests.router.streaming import StreamStarts, stream_completion

pytestmark = pytest.mark.timeout(240)

APP = "conveyor-test-replicas"
STREAM_TOKENS = 400  # long enough to be mid-stream when the kill lands; + the prompt, within the 512 context


@pytest.fixture(scope="module")
def base_url(serve_cluster: str, tiny_model_dir):
    # Small batches so that, under load, most requests wait in an engine queue (not yet streaming).
    args = {"model": str(tiny_model_dir), "served_model_name": "tiny", "num_replicas": 2, "num_kv_blocks": 64,
            "max_num_seqs": 2, "torch_num_threads": 1, "num_cpus": 1}
    with deploy(args, APP, "/replicas"):
        yield serve_cluster + "/replicas"


def replica_actor_names() -> list[str]:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(n for n in names if f"{APP}#EngineReplica#" in n)


def test_both_replicas_serve_traffic(base_url: str) -> None:
    assert len(replica_actor_names()) == 2
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: stream_completion(base_url, f"distinct prompt {i} " * 3, 40),
                                range(16)))
    assert all(r.status == 200 and r.done and r.finish_reason == "length" for r in results)
    assert len({r.replica for r in results}) == 2, [r.replica for r in results]


def test_killing_a_replica_loses_no_unstarted_request(base_url: str) -> None:
    victim = replica_actor_names()[0]
    victim_id = victim.rsplit("#", 1)[-1]
    starts = StreamStarts()
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream_completion, base_url, f"load {i} " * 4, STREAM_TOKENS, starts.note)
                   for i in range(16)]
        # Kill as soon as the victim streams a full batch (2), while the rest wait in queues: a fixed sleep raced
        # the tiny model, whose first streams could finish and free their slots just before the kill. At 150
        # tokens the victim's two streams still finished before the kill landed in ~1 run of 3.
        assert starts.wait_for(lambda counts: counts[victim_id] >= 2, 60), starts.counts
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        results = [f.result(timeout=180) for f in futures]
    cut = [r for r in results if r.error is not None]
    finished = [r for r in results if r.error is None]
    # Never an HTTP error and never a hang: every stream either completes or says it was cut, then [DONE].
    assert all(r.status == 200 and r.done for r in results), [(r.status, r.error) for r in results]
    assert all(r.finish_reason == "length" and r.tokens == STREAM_TOKENS for r in finished)
    # Only streams already running on the victim may be cut; every queued one is retried on the other replica.
    # The bound is two batches, in case both slots turn over between the second stream's start and the kill.
    assert all(r.chunks >= 1 and r.replica == victim_id for r in cut), [(r.replica, r.chunks) for r in cut]
    assert 1 <= len(cut) <= 4, [(r.replica, r.chunks) for r in cut]
    assert len(finished) >= 12
