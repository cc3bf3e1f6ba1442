"""Two engine replicas behind the ingress: both serve, and killing one under load loses no request that had
not started streaming (those are retried on the other); streams cut mid-way end with an SSE error event."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest
import ray

from tests.serve.conftest import deploy

pytestmark = pytest.mark.timeout(240)

APP = "conveyor-test-replicas"


@pytest.fixture(scope="module")
def base_url(serve_cluster: str, tiny_model_dir):
    # Small batches so that, under load, most requests wait in an engine queue (not yet streaming).
    args = {"model": str(tiny_model_dir), "served_model_name": "tiny", "num_replicas": 2, "num_kv_blocks": 64,
            "max_num_seqs": 2, "torch_num_threads": 1, "num_cpus": 1}
    with deploy(args, APP, "/replicas"):
        yield serve_cluster + "/replicas"


@dataclass
class StreamResult:
    status: int = 0
    chunks: int = 0
    tokens: int = 0  # from the usage chunk
    replica: str | None = None
    finish_reason: str | None = None
    error: dict | None = None
    done: bool = False
    events: list[str] = field(default_factory=list)


def stream_completion(url: str, prompt: str, max_tokens: int) -> StreamResult:
    result = StreamResult()
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=90) as resp:
        result.status = resp.status_code
        if resp.status_code != 200:
            resp.read()
            result.error = resp.json().get("error")
            return result
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result.done = True
                continue
            event = json.loads(data)
            if "error" in event:
                result.error = event["error"]
                continue
            result.replica = result.replica or event.get("system_fingerprint")
            if event.get("usage"):  # the last chunk: no choices, the token count
                result.tokens = event["usage"]["completion_tokens"]
                continue
            result.chunks += 1  # a chunk may carry several tokens (a stream that fell behind catches up)
            result.finish_reason = event["choices"][0]["finish_reason"] or result.finish_reason
    return result


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
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream_completion, base_url, f"load {i} " * 4, 150) for i in range(16)]
        time.sleep(1.0)  # let every request reach a replica: two stream on each, the rest wait in queues
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        results = [f.result(timeout=180) for f in futures]
    victim_id = victim.rsplit("#", 1)[-1]
    cut = [r for r in results if r.error is not None]
    finished = [r for r in results if r.error is None]
    # Never an HTTP error and never a hang: every stream either completes or says it was cut, then [DONE].
    assert all(r.status == 200 and r.done for r in results), [(r.status, r.error) for r in results]
    assert all(r.finish_reason == "length" and r.tokens == 150 for r in finished)
    # Only streams already running on the victim may be cut: at most its batch (2), plus one admitted as a
    # batch slot freed just before the kill; every one of them had started streaming from the victim.
    assert len(cut) <= 3, [(r.replica, r.chunks) for r in cut]
    assert all(r.chunks >= 1 and r.replica == victim_id for r in cut)
    assert len(finished) >= 13
