"""A starting replica runs at the engine's niceness, then goes back to Ray's: the calling thread and the threads it
started meanwhile, not the threads that were there before (conveyor/serving/priority.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Run in a child: a niceness once raised cannot be lowered again without CAP_SYS_NICE, and the test process must
# keep its own. The child first raises itself to 5, as Ray's workers run at 15.
PROBE = """
import json, os, threading
from conveyor.serving.priority import raised_priority

def nice(tid=None):
    return os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())

os.setpriority(os.PRIO_PROCESS, 0, 5)
gate = threading.Event()
seen = {}
def worker(key):
    seen[key] = threading.get_native_id()
    gate.wait()
before = threading.Thread(target=worker, args=("before",)); before.start()
with raised_priority(SETTING) as inside:
    started = threading.Thread(target=worker, args=("started",)); started.start()
    while "started" not in seen or "before" not in seen:
        pass
    during = {"main": nice(), "started": nice(seen["started"]), "before": nice(seen["before"])}
after = {"main": nice(), "started": nice(seen["started"]), "before": nice(seen["before"])}
gate.set()
print(json.dumps({"inside": inside, "during": during, "after": after}))
"""


def probe(setting: str) -> dict:
    code = PROBE.replace("SETTING", repr(setting))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def can_lower_niceness() -> bool:
    code = "import os; os.setpriority(os.PRIO_PROCESS, 0, 5); os.setpriority(os.PRIO_PROCESS, 0, 2)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_start_up_runs_at_the_engine_niceness_then_goes_back() -> None:
    result = probe("2")
    if not can_lower_niceness():  # no CAP_SYS_NICE: nothing changes, and nothing fails
        assert result["inside"] == 5 and set(result["during"].values()) == {5}
        return
    assert result["inside"] == 2
    assert result["during"] == {"main": 2, "started": 2, "before": 5}
    assert result["after"] == {"main": 5, "started": 5, "before": 5}


@pytest.mark.parametrize("setting", ["", "5", "9"])
def test_no_change_unless_the_setting_is_a_lower_niceness(setting: str) -> None:
    result = probe(setting)
    assert result["inside"] == 5
    assert set(result["during"].values()) == set(result["after"].values()) == {5}


# A process that asks for SCHED_BATCH, starts a child (as `conveyor serve` starts Ray), and a grandchild that leaves
# the policy (as the engine process does): each prints its own policy.
BATCH_PROBE = """
import json, os, subprocess, sys
from conveyor.serving.priority import run_children_as_batch
ok = run_children_as_batch()
child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
print(json.dumps({"ok": ok, "self": os.sched_getscheduler(0), "child": json.loads(child)}))
"""
CHILD = """
import json, os
from conveyor.serving.priority import leave_batch_policy
inherited = os.sched_getscheduler(0)
leave_batch_policy()
print(json.dumps({"inherited": inherited, "after": os.sched_getscheduler(0)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="scheduling policies are Linux's")
def test_ray_starts_under_sched_batch_and_the_engine_process_leaves_it() -> None:
    probe = f"CHILD = {CHILD!r}\n" + BATCH_PROBE
    out = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                    check=True).stdout)
    assert out["ok"] and out["self"] == os.SCHED_BATCH
    assert out["child"] == {"inherited": os.SCHED_BATCH, "after": os.SCHED_OTHER}


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_the_ray_batch_setting(monkeypatch, value: str | None, expected: bool) -> None:
    from conveyor.serving.priority import RAY_BATCH_ENV, ray_batch_setting

    if value is None:
        monkeypatch.delenv(RAY_BATCH_ENV, raising=False)
    else:
        monkeypatch.setenv(RAY_BATCH_ENV, value)
    assert ray_batch_setting() is expected


def test_a_bad_ray_batch_setting_is_refused(monkeypatch) -> None:
    from conveyor.serving.priority import RAY_BATCH_ENV, ray_batch_setting

    monkeypatch.setenv(RAY_BATCH_ENV, "yes")
    with pytest.raises(ValueError, match=RAY_BATCH_ENV):
        ray_batch_setting()
