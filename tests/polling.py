"""Waiting in tests for something another thread or process makes true."""
from __future__ import annotations

import time
from collections.abc import Callable


def poll_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Whether predicate() became true within timeout_s, checked every interval_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False
