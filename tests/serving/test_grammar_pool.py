"""Grammar compiles run side by side, and one past its time-out frees its place (serving/grammar.py CompilePool)."""
from __future__ import annotations

import threading
import time

import pytest

from conveyor.serving.grammar import CompilePool, RequestGrammar


def _pool(num_threads: int, max_abandoned: int = 2) -> CompilePool:
    return CompilePool(num_threads, max_abandoned, initializer=lambda: None)


def _wait(predicate, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_two_compiles_run_at_the_same_time() -> None:
    pool = _pool(2)
    both = threading.Barrier(2, timeout=5)  # each waits for the other: only passes if both run at once
    futures = [pool.submit(both.wait) for _ in range(2)]
    assert {f.result(timeout=5) for f in futures} == {0, 1}


def test_a_timed_out_compile_frees_its_worker() -> None:
    pool = _pool(1)
    release = threading.Event()
    slow = RequestGrammar(pool.submit(release.wait, 30), timeout_s=0.05, on_timeout=pool.abandon)
    _wait(lambda: slow._future.running())
    queued = pool.submit(lambda: "compiled")
    time.sleep(0.1)
    assert not slow.poll() and "did not compile within" in slow.error
    assert queued.result(timeout=5) == "compiled"  # ran on the replacement while the slow one still runs
    assert pool.num_threads == 2
    release.set()
    _wait(lambda: pool.num_threads == 1)  # the written-off compile ended: its thread left
    assert pool.submit(lambda: 7).result(timeout=5) == 7


def test_a_queued_compile_past_its_time_out_never_runs() -> None:
    pool = _pool(1, max_abandoned=0)
    release = threading.Event()
    pool.submit(release.wait, 30)
    ran = threading.Event()
    queued = RequestGrammar(pool.submit(ran.set), timeout_s=0.01, on_timeout=pool.abandon)
    time.sleep(0.05)
    assert not queued.poll() and queued.failed
    release.set()
    time.sleep(0.1)
    assert not ran.is_set() and pool.num_threads == 1


@pytest.mark.parametrize("max_abandoned", [0, 1])
def test_replacements_are_capped(max_abandoned: int) -> None:
    pool = _pool(1, max_abandoned=max_abandoned)
    release = threading.Event()
    stuck = [pool.submit(release.wait, 30) for _ in range(3)]
    _wait(lambda: stuck[0].running())
    for f in stuck:
        pool.abandon(f)
        if f.running() or max_abandoned:
            time.sleep(0.05)
    assert pool.num_threads <= 1 + max_abandoned
    release.set()
    assert all(f.result(timeout=5) for f in stuck)
