"""`engine_in_ingress` on a real Serve app (conveyor/router/local_engine.py): one deployment, the ingress, holds the
engine; streamed and whole answers agree, readiness and the engine's metrics come from the ingress, and an engine
process killed under it is restarted in place (EngineSupervisor) while the ingress keeps answering."""
from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
from ray import serve

from benchmarks.proc_cpu import cmdline, parent_pids
from tests.router.conftest import deploy, wait_until

pytestmark = pytest.mark.timeout(240)

APP = "conveyor-engine-in-ingress"
BODY = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def base_url(serve_cluster: str, tiny_model_dir):
    args = {"model": str(tiny_model_dir), "served_model_name": "tiny", "engine_in_ingress": True,
            "num_kv_blocks": 64, "max_num_seqs": 4, "torch_num_threads": 1, "num_cpus": 1}
    with deploy(args, APP, "/in-ingress"):
        yield serve_cluster + "/in-ingress"


def _engine_processes() -> dict[int, int]:
    """Engine process pid -> its parent's pid, for the engines whose parent is this app's ingress."""
    return {pid: parent for pid, parent in parent_pids().items()
            if "conveyor.serving.engine_core_loop" in cmdline(pid) and APP in cmdline(parent)
            and "Ingress" in cmdline(parent)}


def _streamed_text(url: str) -> str:
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=BODY | {"stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def test_the_ingress_alone_serves_streamed_and_whole(base_url: str) -> None:
    assert set(serve.status().applications[APP].deployments) == {"Ingress"}
    assert len(_engine_processes()) == 1
    whole = httpx.post(base_url + "/v1/completions", json=BODY, timeout=60)
    assert whole.status_code == 200, whole.text
    assert whole.json()["usage"]["completion_tokens"] == 24
    assert _streamed_text(base_url) == whole.json()["choices"][0]["text"]
    assert httpx.get(base_url + "/ready", timeout=10).json()["ready"] is True
    metrics = httpx.get(base_url + "/metrics", timeout=10).text  # the engine's metrics live in this process
    assert "conveyor_requests_running{" in metrics and "conveyor_time_to_first_token_seconds_count{" in metrics
    bad = httpx.post(base_url + "/v1/completions", json=BODY | {"max_tokens": -3}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_a_killed_engine_restarts_under_the_same_ingress(base_url: str) -> None:
    ((engine, ingress),) = _engine_processes().items()
    os.kill(engine, signal.SIGKILL)

    def answered() -> bool:
        try:
            return httpx.post(base_url + "/v1/completions", json=BODY, timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(answered, 60, "a completion after the engine was killed", 0.5)
    after = _engine_processes()
    assert engine not in after and list(after.values()) == [ingress]  # a new engine, the same ingress process
