"""Admission at the front door: API key (401), full queues (429 + Retry-After), no replica ready (503)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from tests.router.conftest import deploy, engine_state, wait_until

pytestmark = pytest.mark.timeout(180)

APP = "conveyor-test-admission"
KEY = "s3cret-key"


@pytest.fixture(scope="module")
def base_url(serve_cluster: str, tiny_model_dir):
    # One running sequence and two waiting: the fourth concurrent request has nowhere to go.
    args = {"model": str(tiny_model_dir), "served_model_name": "tiny", "num_kv_blocks": 64, "max_num_seqs": 1,
            "max_waiting_requests": 2, "api_key": KEY, "torch_num_threads": 1, "request_router_class": None}
    with deploy(args, APP, "/admission"):
        yield serve_cluster + "/admission"


def test_api_key_required(base_url: str) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        resp = httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    assert httpx.get(base_url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(base_url + "/health", timeout=10).status_code == 200  # probes need no key
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=base_url + "/v1", api_key="nope", max_retries=0).models.list()
    good = OpenAI(base_url=base_url + "/v1", api_key=KEY, timeout=30, max_retries=0)
    assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_overload_gets_429_while_admitted_requests_finish(base_url: str) -> None:
    body = {"prompt": "overload", "max_tokens": 120, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}

    def send(_: int) -> httpx.Response:
        return httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=120)

    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(send, range(12)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= 3  # at least one running + two waiting were admitted
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 120
    state = wait_until(lambda: (s := engine_state(APP))["num_block_tables"] == 0 and s, 10, "idle engine")
    assert state["num_free_blocks"] == state["num_blocks"]


def test_no_replica_ready_gets_503(serve_cluster: str, tiny_model_dir) -> None:
    # An engine that can never be placed (64 CPUs on a 4-CPU cluster): the ingress is up, no replica is.
    args = {"model": str(tiny_model_dir), "num_cpus": 64, "replica_wait_timeout_s": 1.0,
            "request_router_class": None}
    url = serve_cluster + "/noreplica"
    with deploy(args, "conveyor-test-noreplica", "/noreplica", wait=False):
        wait_until(lambda: _status(url + "/health") == 200, 60, "the ingress to come up")
        resp = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert resp.status_code == 503, resp.text
        assert resp.headers["Retry-After"] and resp.json()["error"]["code"] == "no_replica"
        # Liveness says the ingress is up; readiness says no engine can serve: a load balancer sends nothing.
        ready = httpx.get(url + "/ready", timeout=30)
        assert ready.status_code == 503 and ready.json()["ready"] is False, ready.text


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0
