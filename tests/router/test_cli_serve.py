"""`conveyor serve` as a user runs it, in its own process and its own local Ray: the ingress listens on --port
itself (direct ingress, no Serve proxy), streams reassemble to the non-streamed answer through the official
client (with a stream_interval from the YAML file), and a stop signal leaves no engine process behind."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from benchmarks.proc_cpu import cmdline, descendants, parent_pids
from tests.router.conftest import _free_port, wait_until

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny"
LOGS: dict[str, Path] = {}
STREAM_INTERVAL = 3  # from the YAML file: tokens leave the replica three at a time, the first alone


def _processes() -> list[tuple[int, int, str]]:
    """(pid, parent pid, command line) of every process now."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append((int(entry), int(stat.rsplit(")", 1)[1].split()[1]), cmd))
    return found


def _engine_pids() -> set[int]:
    return {pid for pid, _, cmd in _processes() if "conveyor.serving.engine_core_loop" in cmd}


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _start(model_dir: Path, log_dir: Path, config: Path, new_session: bool = False
           ) -> tuple[str, subprocess.Popen, Path]:
    """`conveyor serve` in a local Ray cluster of its own, answering; returns its URL, process and log. With
    new_session it leads a process group of its own (as under systemd), its Ray processes in it."""
    port = _free_port()
    log_path = log_dir / "serve.log"
    # RAY_ADDRESS=local: a cluster of its own, whatever else runs on this host (the suite's own Ray). Ray's token
    # authentication as a user gets it (the suite's RAY_AUTH_MODE=disabled left out), with a token of its own
    # so no ~/.ray/auth_token is written.
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {
        "RAY_ADDRESS": "local", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    cmd = [sys.executable, "-m", "conveyor.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--num-kv-blocks", "64", "--max-num-seqs", "8", "--num-cpus", "1", "--config", str(config)]
    with open(log_path, "w") as log:
        # Started with SIGINT ignored, as a shell starts a background job (`conveyor serve &`).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=new_session,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or _ready(url), 180, "conveyor serve to answer", 0.5)
        assert proc.poll() is None, f"conveyor serve exited early: {log_path.read_text()[-3000:]}"
    except BaseException:
        _stop(proc)
        raise
    return url, proc, log_path


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen, set[int]]]:
    before = _engine_pids()
    url, proc, log_path = _start(tiny_model_dir, tmp_path_factory.mktemp("cli-serve"), _config(tmp_path_factory))
    LOGS["serve"] = log_path
    try:
        yield url, proc, before
    finally:
        _stop(proc)


def _config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli-serve-config") / "args.yaml"
    path.write_text(f"served_model_name: {MODEL}\nstream_interval: {STREAM_INTERVAL}\n")
    return path


def test_streams_reassemble_through_the_direct_ingress(server) -> None:
    url, _, _ = server
    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=60, max_retries=0)
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=40, temperature=0.0,
                  extra_body={"ignore_eos": True}, logprobs=1)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [t for c in text_chunks for t in c.choices[0].logprobs.tokens] == full.choices[0].logprobs.tokens
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 40
    sizes = [len(c.choices[0].logprobs.tokens) for c in text_chunks]
    assert sizes[0] == 1 and all(n >= STREAM_INTERVAL for n in sizes[1:-1]), sizes
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=16, temperature=0.0,
                stop=["zz"], extra_body={"ignore_eos": True})
    answer = client.chat.completions.create(**chat).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **chat))
    assert streamed == answer


def _engine_gauge(url: str, name: str) -> float:
    """A gauge of the engine replica, read from its own metrics endpoint (found through service discovery)."""
    targets = httpx.get(url + "/metrics/targets", timeout=5).json()
    address = next(t["targets"][0] for t in targets if t["labels"].get("conveyor_role") == "engine")
    for line in httpx.get(f"http://{address}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_a_client_gone_mid_stream_frees_the_engine(server) -> None:
    url, _, _ = server
    body = {"model": MODEL, "prompt": "a long answer please", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data:")
            next(lines)
        wait_until(lambda: _engine_gauge(url, "conveyor_requests_running") == 1, 10, "the stream to be running")
    # Closing the connection reached the ingress directly (no proxy): the engine must let the request go.
    wait_until(lambda: _engine_gauge(url, "conveyor_requests_running") == 0, 15, "the aborted request to end")
    wait_until(lambda: _engine_gauge(url, "conveyor_kv_cache_usage_ratio") == 0, 15, "its blocks to be free")


def test_the_local_ray_runs_no_log_monitor(server) -> None:
    """Without -v no worker output goes to the driver, so Ray's log monitor (which polls the log folder ten
    times a second to stream it there) is stopped after start (conveyor/router/serve_cli.py, _stop_log_monitor)."""
    _, proc, _ = server
    children = [cmd for _, parent, cmd in _processes() if parent == proc.pid]
    assert any("gcs_server" in c for c in children), children  # the driver started this Ray's processes
    assert not [c for c in children if "log_monitor.py" in c]


def test_the_local_ray_runs_no_serve_proxy(server) -> None:
    """Direct ingress leaves Serve's HTTP proxy without traffic, so the controller places none
    (conveyor/router/worker_setup.py); the ingress replica answers on --port (the other tests)."""
    _, proc, _ = server
    workers = [cmdline(pid) for pid in descendants({proc.pid})]
    assert any("ServeController" in c for c in workers) and any("Ingress" in c for c in workers), workers
    assert not [c for c in workers if "ProxyActor" in c]


def test_the_engine_runs_in_the_ingress(server) -> None:
    """One fixed replica: the engine client lives in the ingress process (conveyor/router/local_engine.py), so the
    engine child is the ingress's own and no EngineReplica worker relays the tokens (the other tests stream through
    it)."""
    _, proc, before = server
    workers = {pid: cmdline(pid) for pid in descendants({proc.pid})}
    assert not [c for c in workers.values() if "EngineReplica" in c]
    mine = _engine_pids() - before
    parents = {parent for pid, parent in parent_pids().items() if pid in mine}
    assert parents and all("Ingress" in workers.get(parent, "") for parent in parents), (parents, workers)


def test_the_local_ray_keeps_token_authentication(server) -> None:
    """`conveyor serve` no longer turns Ray's token authentication off (issue 39): the GCS it started runs in token
    mode, so a client without the token cannot run code in the cluster."""
    _, proc, _ = server
    assert "authentication token" in LOGS["serve"].read_text()
    (gcs,) = [pid for pid, parent, cmd in _processes() if parent == proc.pid and "gcs_server" in cmd]
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{gcs}/environ").read_text().split("\0") if "=" in item)
    assert environ.get("RAY_AUTH_MODE") == "token" and environ.get("RAY_AUTH_TOKEN")


def test_ray_runs_under_sched_batch_and_the_engine_does_not(server) -> None:
    """Ray's processes inherit the driver's SCHED_BATCH (a waking one waits for the engine's slice instead of
    preempting it); every thread of the engine process runs under the normal policy (conveyor/serving/priority.py)."""
    _, proc, before = server
    ray_pids = [pid for pid, parent, cmd in _processes()
                if (parent == proc.pid and "gcs_server" in cmd) or cmd.startswith("ray::ServeRepli")]
    assert len(ray_pids) >= 2, "the GCS and a replica"
    assert {os.sched_getscheduler(pid) for pid in ray_pids} == {os.SCHED_BATCH}
    engine = _engine_pids() - before
    assert engine
    threads = [int(t) for pid in engine for t in os.listdir(f"/proc/{pid}/task")]
    assert {os.sched_getscheduler(tid) for tid in threads} == {os.SCHED_OTHER}


def test_sigint_stops_every_engine_process(server) -> None:
    """`kill -INT` stops a server whose SIGINT was ignored at start (SIGTERM takes the same handler)."""
    url, proc, before = server
    assert _ready(url)
    mine = _engine_pids() - before
    assert mine, "no engine child process found for conveyor serve"
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=90)
    wait_until(lambda: not (_engine_pids() & mine), 30, "the engine process to exit")
    assert time.monotonic() - started < 90


def test_sigterm_to_its_process_group_stops_it_promptly(tiny_model_dir, tmp_path_factory) -> None:
    """systemd's default KillMode and `timeout` send SIGTERM to every process of the group, Ray's own too: the server
    still exits 0 with its engine, in seconds, where it waited 30-60 s on a Serve controller already gone."""
    before = _engine_pids()
    _, proc, log_path = _start(tiny_model_dir, tmp_path_factory.mktemp("cli-serve-group"), _config(tmp_path_factory),
                               new_session=True)
    try:
        wait_until(lambda: "is serving" in log_path.read_text(), 60, "serve.run to return")
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        assert time.monotonic() - started < 25, log_path.read_text()[-2000:]
        wait_until(lambda: not (_engine_pids() - before), 30, "the engine process to exit")
    finally:
        _stop(proc)


def test_exits_when_its_ray_cluster_stops(tiny_model_dir, tmp_path_factory) -> None:
    """A `ray stop` from another shell (here: its GCS killed) ends `conveyor serve` with exit status 1 and a line
    that says why, its engine process with it, instead of a process that waits forever on a core."""
    before = _engine_pids()
    _, proc, log_path = _start(tiny_model_dir, tmp_path_factory.mktemp("cli-serve-lost"), _config(tmp_path_factory))
    try:
        wait_until(lambda: "is serving" in log_path.read_text(), 60, "serve.run to return")
        gcs = [pid for pid, parent, cmd in _processes() if parent == proc.pid and "gcs_server" in cmd]
        assert gcs, "no GCS process under conveyor serve"
        os.kill(gcs[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        assert "the Ray cluster lost its gcs_server" in log_path.read_text()
        wait_until(lambda: not (_engine_pids() - before), 30, "the engine process to exit")
    finally:
        _stop(proc)
