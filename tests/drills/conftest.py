"""Failure drills share the tests/serve cluster helpers (deploy, wait_until, engine_state).

`serve_cluster` here is package-scoped rather than session-scoped: when this directory runs in the same session
as tests/serve (which collects later and starts its own Serve on its own port), our Serve must be gone by then,
or tests/serve's fixture would connect to it and aim its requests at a port nobody listens on. If Serve is
already running (tests/serve ran first), we attach to it and leave it alone.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before ray is imported: token auth is on by default

import ray  # noqa: E402
from ray import serve  # noqa: E402

from tests.serve.conftest import _free_port  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "drills"


def _running_serve_port() -> int | None:
    if not ray.is_initialized():
        return None
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return client.http_config.port if client is not None else None


@pytest.fixture(scope="package")
def serve_cluster() -> Iterator[str]:
    port = _running_serve_port()
    if port is not None:
        yield f"http://127.0.0.1:{port}"
        return
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()


def write_artifact(name: str, data: dict[str, Any]) -> Path:
    """Drill figures (latencies, counts) go to benchmarks/results/drills/NAME.json and to the test output."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\n{name}: {json.dumps(data, default=str)}")
    return path
