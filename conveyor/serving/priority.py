"""CPU priority (Linux niceness) of the engine process and of a starting replica.

Ray starts its workers (our replicas, their engine's child process, and Ray's proxy, controller and helpers) at
nice 15. The engine's OpenMP team has a thread per core: whenever one of those processes takes a core, the whole
team waits at its next barrier, so the engine process lowers its niceness to 0 (CONVEYOR_ENGINE_NICE; "" leaves
the inherited niceness). A replica that starts on a node whose engines are busy then gets ~1/28 of a core against
each of them: on 2 cores beside two busy tiny-model engines its start took 28-36 s, against 19 s at their
priority. It therefore runs its start-up at the engine's niceness and returns to Ray's for serving
(`raised_priority`).

Linux niceness is per thread, and a new thread starts at its creator's niceness. Lowering it needs CAP_SYS_NICE
(root has it); without it everything stays at Ray's niceness, logged.

`conveyor serve` also starts its local Ray under SCHED_BATCH (`run_children_as_batch`): a batch thread that wakes
does not preempt the thread running on its core, it waits for that thread's slice to end or for it to sleep. Ray's
~100 wake-ups a second per worker (its core worker's 10 ms signal check) then stop breaking into the engine's
OpenMP team mid-region; they still get their share of CPU, unlike SCHED_IDLE, which starved the path (RESULTS.md,
sessions 12 and 26). The engine process goes back to the normal policy (`leave_batch_policy`).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from conveyor import envs

logger = logging.getLogger(__name__)

RAY_BATCH_ENV = envs.RAY_SCHED_BATCH


def engine_niceness_setting() -> str:
    """CONVEYOR_ENGINE_NICE as set (default "0"); "" means: keep the niceness Ray gave."""
    return envs.get(envs.ENGINE_NICE)


def set_engine_priority(setting: str) -> int:
    """Lower this process's niceness to `setting` before any thread exists (threads inherit it); return the
    niceness it runs at. Without CAP_SYS_NICE the engine keeps its niceness, logged."""
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    if not setting.strip() or int(setting) == current:
        return current
    return int(setting) if _try_set(tid, int(setting), "engine process") else current


@contextmanager
def raised_priority(setting: str | None = None) -> Iterator[int]:
    """Run the calling thread, and every thread it starts meanwhile, at the engine's niceness (setting, default
    CONVEYOR_ENGINE_NICE); on exit put the calling thread and those threads back at the niceness it had. Yields
    the niceness the block ran at. Only a lower niceness is applied: a block never runs slower than without."""
    setting = engine_niceness_setting() if setting is None else setting
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    target = int(setting) if setting.strip() else before
    # Elsewhere niceness is per process (macOS) and /proc/self/task does not exist: left alone there.
    if not sys.platform.startswith("linux") or target >= before or not _try_set(tid, target, "replica start-up"):
        yield before
        return
    existing = _thread_ids()
    try:
        yield target
    finally:
        for other in (_thread_ids() - existing) | {tid}:
            # Only the block's own threads: Ray's threads keep whatever they run at.
            if _niceness(other) == target:
                _try_set(other, before, "replica thread")


def _try_set(tid: int, niceness: int, what: str) -> bool:
    try:
        os.setpriority(os.PRIO_PROCESS, tid, niceness)
        return True
    except PermissionError:
        logger.warning("%s stays at nice %d: lowering it to %d needs CAP_SYS_NICE", what,
                       os.getpriority(os.PRIO_PROCESS, tid), niceness)
        return False
    except ProcessLookupError:  # the thread ended meanwhile
        return False


def _niceness(tid: int) -> int | None:
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except ProcessLookupError:
        return None


def _thread_ids() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/task")}


def ray_batch_setting() -> bool:
    """CONVEYOR_RAY_SCHED_BATCH: "1" (default) starts `conveyor serve`'s local Ray under SCHED_BATCH, "0" not."""
    value = envs.get(RAY_BATCH_ENV).strip()
    if value not in ("0", "1"):
        raise ValueError(f"{RAY_BATCH_ENV}={value!r}: expected 0 or 1")
    return value == "1"


def run_children_as_batch() -> bool:
    """Put the calling thread under SCHED_BATCH, at its niceness, so that every process it starts from now on
    inherits it. False where the platform has no such policy or refuses it (logged)."""
    if not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        return True
    except OSError as exc:
        logger.warning("Ray's processes stay under the normal scheduling policy: %s", exc)
        return False


def leave_batch_policy() -> None:
    """The engine process runs under the normal policy whatever it inherited: its threads must take a core as
    soon as they wake. Call it before any thread exists (threads inherit their creator's policy)."""
    if not hasattr(os, "SCHED_BATCH"):
        return
    try:
        if os.sched_getscheduler(0) in (os.SCHED_BATCH, os.SCHED_IDLE):
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError as exc:  # leaving SCHED_IDLE can need CAP_SYS_NICE
        logger.warning("the engine process keeps its inherited scheduling policy: %s", exc)
