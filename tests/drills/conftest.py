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


from tests.serve.conftest import attached_or_new_serve  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "drills"


@pytest.fixture(scope="package")
def serve_cluster() -> Iterator[str]:
    with attached_or_new_serve() as url:
        yield url


def write_artifact(name: str, data: dict[str, Any]) -> Path:
    """Drill figures (latencies, counts) go to benchmarks/results/drills/NAME.json and to the test output."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\n{name}: {json.dumps(data, default=str)}")
    return path
