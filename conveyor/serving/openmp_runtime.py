"""Which OpenMP runtime the engine's child process runs on, and how long its idle threads spin.

torch's CPU wheel and our kernels are built against GNU OpenMP (libgomp). Intel's runtime (libiomp5, the PyPI
package `intel-openmp`) serves the same GOMP entry points, and preloaded it replaces libgomp for every parallel
region of the process, as vLLM's CPU guide and Intel's PyTorch guide recommend. It makes the engine faster in
process, and more so behind `conveyor serve`, where Ray's processes keep taking the engine's cores: its threads
lose less to those preemptions (figures: benchmarks/RESULTS.md, "Defaults and the measurements behind them").

A runtime is chosen when a process starts (LD_PRELOAD), so only the engine's child process, which we start, gets
it. An in-process `LLM` runs on whichever runtime its process started with.

CONVEYOR_ENGINE_OPENMP: `auto` (default: Intel's when installed, else GNU's), `intel` (an error if it is not
installed), `gnu` (the runtime torch was built with).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Collection, Mapping
from pathlib import Path

from conveyor import envs

OPENMP_ENV = envs.ENGINE_OPENMP
BIND_ENV = envs.ENGINE_BIND_THREADS
BIND_CHOICES = ("auto", "off")
# Set by the user, any of these decides where the threads run: then we bind nothing.
BINDING_VARS = ("KMP_AFFINITY", "GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES")
OPENMP_CHOICES = ("auto", "intel", "gnu")
INTEL_OPENMP_LIBRARY = "libiomp5.so"


def intel_openmp_library() -> Path | None:
    """libiomp5.so as `pip install intel-openmp` lays it out: under the environment's lib/."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        candidate = Path(prefix) / "lib" / INTEL_OPENMP_LIBRARY
        if candidate.is_file():
            return candidate
    return None


def child_openmp_env(parent: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to the engine child's environment for the runtime `parent` asks for."""
    choice = envs.get(OPENMP_ENV, parent).strip().lower() or "auto"
    if choice not in OPENMP_CHOICES:
        raise ValueError(f"{OPENMP_ENV}={parent[OPENMP_ENV]!r}: expected one of {', '.join(OPENMP_CHOICES)}")
    if choice == "gnu":
        return {}
    library = intel_openmp_library()
    if library is None:
        if choice == "intel":
            raise ValueError(f"{OPENMP_ENV}=intel, but {INTEL_OPENMP_LIBRARY} is not under {sys.prefix}/lib: "
                             "pip install intel-openmp, or set it to auto or gnu")
        return {}
    preload = preloaded(parent)
    if any(Path(p).name.startswith(("libiomp", "libgomp", "libomp")) for p in preload):
        return {}  # the user chose a runtime already
    return {"LD_PRELOAD": ":".join([str(library), *preload])}


def preloaded(env: Mapping[str, str]) -> list[str]:
    """The libraries env's LD_PRELOAD names (the loader takes colons or spaces between them)."""
    return [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]


def loaded_openmp_runtime() -> str:
    """"intel" or "gnu": the runtime this process's parallel regions run on (the first one mapped wins the
    symbols, and a preloaded library is mapped first)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    if "libiomp5" in maps:
        return "intel"
    return "gnu" if "libgomp" in maps else "unknown"


# How long an idle OpenMP thread of the engine spins before it sleeps. Behind a server the engine shares the cores
# with the replica, the ingress, Ray and the client: a thread that spins at a barrier while its partner was preempted
# burns the core the preempting process needs, and its partner waits for a core meanwhile. A short spin gives the core
# back (chosen before the threads were bound, below, when it also let the partner move onto it; not re-tuned since).
# On GNU's runtime: 10 000 iterations instead of libgomp's 300 000. On Intel's, which the child prefers (above):
# KMP_BLOCKTIME 1 ms instead of 200; sleeping at once (0) is worse, since every barrier then waits on a futex wake.
# Both raise output tok/s at saturation on 2 cores, and 1 ms also cuts the engine's CPU for the same work (figures:
# benchmarks/RESULTS.md, "Defaults and the measurements behind them"). A value already set wins.
ENGINE_OMP_SPIN_COUNT = "10000"
ENGINE_KMP_BLOCKTIME_MS = "1"


def engine_child_env(parent: Mapping[str, str], num_threads: int | None = None) -> dict[str, str]:
    """The engine child's environment: parent's, its OpenMP runtime, spin time and thread binding. num_threads:
    the child's torch threads (None: OMP_NUM_THREADS, as torch reads it)."""
    env = dict(parent)
    env.setdefault("GOMP_SPINCOUNT", ENGINE_OMP_SPIN_COUNT)
    env.setdefault("KMP_BLOCKTIME", ENGINE_KMP_BLOCKTIME_MS)
    env.update(child_openmp_env(parent))
    env.update(thread_binding_env(env, num_threads, os.sched_getaffinity(0)))
    return env


# Where the engine's team runs. Left to the kernel, a thread of a server's other processes (the ingress, Ray, the
# client) that wakes on one core makes the kernel move an engine thread onto the other core, where its partner
# runs: the two then take turns on one core while the first waits on the woken thread, and the whole team stalls at
# every barrier meanwhile. Behind `conveyor serve` on 2 cores each engine thread was preempted ~700 times a second,
# two thirds of them by its partner, and the engine child got 1.68-1.76 of the 2 cores; in process, without the
# wake-ups, 60 a second. One thread bound to each CPU cannot be stacked (benchmarks/RESULTS.md, "Goodput").
# Only a team that covers every CPU the process may use is bound: a smaller one shares the node with other
# engines, which would all bind to the same first CPUs.
def thread_binding_env(env: Mapping[str, str], num_threads: int | None, cpus: Collection[int]) -> dict[str, str]:
    """KMP_AFFINITY (Intel's or LLVM's runtime preloaded in env) or GOMP_CPU_AFFINITY binding thread i of the team
    to the i-th of cpus, when CONVEYOR_ENGINE_BIND_THREADS is auto, the team has exactly one thread per CPU of
    cpus (at least 2), and env sets no binding of its own; else nothing."""
    choice = envs.get(BIND_ENV, env).strip().lower() or "auto"
    if choice not in BIND_CHOICES:
        raise ValueError(f"{BIND_ENV}={env[BIND_ENV]!r}: expected one of {', '.join(BIND_CHOICES)}")
    if choice == "off" or any(var in env for var in BINDING_VARS):
        return {}
    team = num_threads or _positive_int(env.get("OMP_NUM_THREADS", ""))
    if team is None or team < 2 or team != len(cpus):
        return {}
    ordered = sorted(cpus)
    if any(Path(p).name.startswith(("libiomp", "libomp")) for p in preloaded(env)):
        return {"KMP_AFFINITY": f"granularity=fine,explicit,proclist=[{','.join(map(str, ordered))}]"}
    return {"GOMP_CPU_AFFINITY": " ".join(map(str, ordered))}


def _positive_int(text: str) -> int | None:
    try:
        value = int(text.strip().split(",")[0])  # OMP_NUM_THREADS may list nested levels: the first is the team
    except ValueError:
        return None
    return value if value > 0 else None
