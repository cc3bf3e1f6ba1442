"""The engine of one replica (router/replica.py), kept running: started from a factory, restarted in place when its
process dies, and judged for Serve's health check (dead, restarting, wedged, or faulted on the GPU). No Ray here:
testable without it."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from conveyor.serving.engine_client import EngineClient

logger = logging.getLogger(__name__)


class EngineSupervisor:
    def __init__(self, factory: Callable[[], EngineClient], *, stall_timeout_s: float, name: str = "",
                 on_start: Callable[[EngineClient], None] | None = None) -> None:
        """factory builds an engine (now, and again after its process died). on_start(engine) runs for every engine
        started, before it takes requests: the replica binds its metrics there."""
        self._factory = factory
        self._name = name  # the replica's id, for the log
        self._on_start = on_start
        self.stall_timeout_s = stall_timeout_s
        self.restarting = False
        self.num_restarts = 0
        self._restart_began = 0.0
        self.restart_error: str | None = None  # the last restart's failure: the health check fails for good
        # Liveness of the engine itself: a step completed recently, or nothing to do (see health_problem).
        self._last_progress = time.monotonic()
        self.engine = factory()
        self._attach(self.engine)

    def _attach(self, engine: EngineClient) -> None:
        if self._on_start is not None:
            self._on_start(engine)
        engine.add_step_listener(self._on_step)
        if hasattr(engine, "on_exit"):  # ProcessEngine: its child can die under us
            engine.on_exit = self._on_engine_exit

    def _on_step(self, stats: Any, outputs: Any) -> None:
        self._last_progress = time.monotonic()

    def _on_engine_exit(self) -> None:
        """The engine process died (kill -9, OOM); its streams have failed already. Start a new one beside: the
        replica hands back whatever arrives until it is up (seconds), far sooner than Serve could replace the
        whole replica (health_problem lets it, for up to stall_timeout_s)."""
        if self.restarting:
            return
        if self.engine.device_fault is not None:  # health_problem fails from now on: Serve replaces the replica
            logger.critical("engine of replica %s met a GPU device-side fault; the replica must be replaced: %s",
                            self._name, self.engine.device_fault)
            return
        self.restarting = True
        self._restart_began = time.monotonic()
        logger.error("engine process of replica %s died; restarting it", self._name)
        threading.Thread(target=self._restart, name="conveyor-engine-restart", daemon=True).start()

    def _restart(self) -> None:
        old = self.engine
        try:
            old.shutdown()
            engine = self._factory()
        except Exception as exc:  # noqa: BLE001 - the health check fails from now on: Serve replaces the replica
            logger.exception("engine restart failed on replica %s", self._name)
            self.restart_error = repr(exc)
            self.restarting = False
            return
        self._attach(engine)
        self.engine = engine
        self._last_progress = time.monotonic()
        self.num_restarts += 1
        self.restarting = False
        logger.warning("engine process of replica %s restarted in %.1f s", self._name,
                       time.monotonic() - self._restart_began)

    def health_problem(self) -> str | None:
        """Why the replica is unhealthy now, or None. A live engine that has work but completed no step for
        stall_timeout_s is (a wedged engine: Serve would otherwise keep routing to it), and so is a restart that
        has taken as long, or failed. A restart under way is not: Serve's 3 failed checks (15 s at the default
        period) are about what a loaded 2-core host needs for one, and replacing the replica then would start
        a whole new one (model load included) in place of an engine that is nearly up; the replica hands back what
        arrives meanwhile. An engine that met a GPU device-side fault is for good: its replica's CUDA device may be
        unusable, so it is not restarted in place; Serve replaces the replica after its failure threshold."""
        if self.engine.device_fault is not None:
            return f"engine met a GPU device-side fault; this replica must be replaced: {self.engine.device_fault}"
        if self.restart_error is not None:
            return f"engine restart failed: {self.restart_error}"
        if self.restarting:
            restarting_s = time.monotonic() - self._restart_began
            if restarting_s > self.stall_timeout_s:
                return (f"engine restart has taken {restarting_s:.0f} s "
                        f"(engine_stall_timeout_s={self.stall_timeout_s:g})")
            return None
        if not self.engine.is_alive():
            return "engine is not running"
        stalled_s = self.stalled_s()
        if stalled_s > self.stall_timeout_s:
            return (f"engine made no progress for {stalled_s:.0f} s with work queued "
                    f"(engine_stall_timeout_s={self.stall_timeout_s:g})")
        return None

    def stalled_s(self) -> float:
        """Seconds since the engine last showed progress while it had work; 0 while idle."""
        now = time.monotonic()
        if not self.engine.has_work():
            self._last_progress = now  # idle is progress: the clock starts when work is there
            return 0.0
        return now - self._last_progress

    def shutdown(self) -> None:
        self.engine.shutdown()
