"""Live fixtures for the metrics tests: the session's Ray/Serve cluster and a real Prometheus server on loopback."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before ray is imported: token auth is on by default

from tests.router.conftest import deploy, wait_until  # noqa: E402,F401 - re-exported


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def metrics_cluster(serve_cluster: str) -> str:
    """The session's Serve proxy (tests/router/conftest.py)."""
    return serve_cluster


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        r.raise_for_status()
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def targets(self) -> list[dict]:
        return httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]


def start_prometheus(sd_url: str, tmp: Path, scrape_interval: str = "1s") -> Prometheus:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the prometheus server is not installed (scripts/setup.sh installs it)")
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "prometheus.yml"
    # The same shape as deploy/prometheus/prometheus.yml, with test-speed intervals.
    config.write_text(f"""global:
  scrape_interval: {scrape_interval}
  evaluation_interval: {scrape_interval}
scrape_configs:
  - job_name: conveyor
    http_sd_configs:
      - url: {sd_url}
        refresh_interval: 1s
""")
    port = free_port()
    log = tmp / "prometheus.log"
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {log.read_text()[-2000:]}")
        try:
            return httpx.get(f"{prom.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, 30, "prometheus to be ready", interval_s=0.2)
    return prom


def stop_prometheus(prom: Prometheus) -> None:
    prom.proc.terminate()
    try:
        prom.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        prom.proc.kill()
        prom.proc.wait(timeout=5)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5):  # noqa: ANN001, ANN201
    """wait_until that tolerates transient errors from the predicate until the deadline."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001
            last = exc
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what} (last error: {last!r})")
