"""Failure drills share the tests/router helpers (deploy, wait_until, engine_state) and the session's Serve
(`serve_cluster`, tests/conftest.py)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

# Never a tracked path: a test run must leave the checkout clean. $CONVEYOR_ARTIFACTS keeps them (CI uploads it).
ARTIFACTS = Path(os.environ.get("CONVEYOR_ARTIFACTS") or Path(tempfile.gettempdir()) / "conveyor-artifacts") / "drills"


def write_artifact(name: str, data: dict[str, Any]) -> Path:
    """Drill figures (latencies, counts) go to $CONVEYOR_ARTIFACTS/drills/NAME.json (else the same path under the
    system's temp dir) and to the test output."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\n{name}: {json.dumps(data, default=str)}")
    return path
