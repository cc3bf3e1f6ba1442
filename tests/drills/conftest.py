"""Failure drills share the tests/serve helpers (deploy, wait_until, engine_state) and the session's Serve
(`serve_cluster`, tests/conftest.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ARTIFACTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "drills"


def write_artifact(name: str, data: dict[str, Any]) -> Path:
    """Drill figures (latencies, counts) go to benchmarks/results/drills/NAME.json and to the test output."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\n{name}: {json.dumps(data, default=str)}")
    return path
