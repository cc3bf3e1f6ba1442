"""The replica's engine supervisor (router/engine_supervisor.py) without Ray: an engine process that dies is restarted
in place; one that met a GPU device-side fault is not, and the replica's health check fails until Serve replaces it;
an engine with work and no step for the stall time-out fails it too."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from conveyor.router.engine_supervisor import EngineSupervisor
from tests.polling import poll_until


class FakeEngine:
    """What the supervisor reads of an engine; `die` ends it as the engine process's reader does."""

    def __init__(self) -> None:
        self.alive = True
        self.device_fault: str | None = None
        self.work = False
        self.listeners: list[Callable[[Any, Any], None]] = []
        self.on_exit: Callable[[], None] | None = None
        self.shut_down = threading.Event()

    def add_step_listener(self, fn: Callable[[Any, Any], None]) -> None:
        self.listeners.append(fn)

    def is_alive(self) -> bool:
        return self.alive

    def has_work(self) -> bool:
        return self.work

    def shutdown(self) -> None:
        self.shut_down.set()

    def die(self, device_fault: str | None = None) -> None:
        self.alive, self.device_fault = False, device_fault
        self.on_exit()


def _supervisor(stall_timeout_s: float = 60.0) -> tuple[EngineSupervisor, list[FakeEngine], list[FakeEngine]]:
    built: list[FakeEngine] = []
    started: list[FakeEngine] = []

    def factory() -> FakeEngine:
        built.append(FakeEngine())
        return built[-1]

    return EngineSupervisor(factory, stall_timeout_s=stall_timeout_s, on_start=started.append), built, started


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    return poll_until(predicate, timeout_s, interval_s=0.01)


def test_a_dead_engine_process_is_restarted_in_place() -> None:
    supervisor, built, started = _supervisor()
    assert supervisor.health_problem() is None
    built[0].die()
    assert _wait_for(lambda: supervisor.num_restarts == 1)
    assert len(built) == 2 and supervisor.engine is built[1] and started == built  # metrics bound to the new one
    assert built[0].shut_down.is_set()
    assert supervisor.health_problem() is None


def test_a_device_fault_fails_the_health_check_for_good_without_a_restart() -> None:
    supervisor, built, _ = _supervisor()
    built[0].die(device_fault="CUDA error: an illegal memory access was encountered")
    time.sleep(0.1)  # a restart would have started by now
    assert len(built) == 1 and supervisor.num_restarts == 0 and not supervisor.restarting
    problem = supervisor.health_problem()
    assert problem is not None and "device-side fault" in problem and "illegal memory access" in problem


def test_an_engine_with_work_and_no_step_is_unhealthy_after_the_stall_time_out() -> None:
    supervisor, built, _ = _supervisor(stall_timeout_s=0.3)
    built[0].work = True
    assert supervisor.health_problem() is None  # the clock starts when work is there
    time.sleep(0.4)
    assert "no progress" in supervisor.health_problem()
    for listener in built[0].listeners:  # a step completes
        listener(None, [])
    assert supervisor.health_problem() is None


def _slow_factory_supervisor(stall_timeout_s: float, fail: bool = False) -> tuple[EngineSupervisor, threading.Event]:
    """The first engine builds at once; a restart blocks until `release` is set, then builds (or raises)."""
    release = threading.Event()
    built: list[FakeEngine] = []

    def factory() -> FakeEngine:
        if built:
            release.wait(10)
            if fail:
                raise RuntimeError("no memory for the model")
        built.append(FakeEngine())
        return built[-1]

    supervisor = EngineSupervisor(factory, stall_timeout_s=stall_timeout_s)
    built[0].die()
    return supervisor, release


def test_a_restart_under_way_passes_the_health_check_until_the_stall_time_out() -> None:
    # Serve's 3 failed checks (15 s) are about what a restart takes on a loaded 2-core host: failing them would have
    # Serve replace a replica whose engine is nearly up.
    supervisor, release = _slow_factory_supervisor(stall_timeout_s=0.3)
    assert supervisor.restarting and supervisor.health_problem() is None
    time.sleep(0.4)
    problem = supervisor.health_problem()
    assert problem is not None and "restart has taken" in problem
    release.set()
    assert _wait_for(lambda: supervisor.num_restarts == 1)
    assert supervisor.health_problem() is None


def test_a_failed_restart_fails_the_health_check_for_good() -> None:
    supervisor, release = _slow_factory_supervisor(stall_timeout_s=60.0, fail=True)
    release.set()
    assert _wait_for(lambda: supervisor.restart_error is not None)
    problem = supervisor.health_problem()
    assert problem is not None and "restart failed" in problem and "no memory" in problem
    assert supervisor.num_restarts == 0 and not supervisor.restarting
