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

import sys
from collections.abc import Mapping
from pathlib import Path

from conveyor import envs

OPENMP_ENV = envs.ENGINE_OPENMP
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
    preload = [p for p in parent.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    if any(Path(p).name.startswith(("libiomp", "libgomp", "libomp")) for p in preload):
        return {}  # the user chose a runtime already
    return {"LD_PRELOAD": ":".join([str(library), *preload])}


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
# back (and lets the partner move onto it). On GNU's runtime: 10 000 iterations instead of libgomp's 300 000. On
# Intel's, which the child prefers (above): KMP_BLOCKTIME 1 ms instead of 200; sleeping at once (0) is
# worse, since every barrier then waits on a futex wake. Both raise output tok/s at saturation on 2 cores, and 1 ms
# also cuts the engine's CPU for the same work (figures: benchmarks/RESULTS.md, "Defaults and the measurements
# behind them"). A value already set wins.
ENGINE_OMP_SPIN_COUNT = "10000"
ENGINE_KMP_BLOCKTIME_MS = "1"


def engine_child_env(parent: Mapping[str, str]) -> dict[str, str]:
    env = dict(parent)
    env.setdefault("GOMP_SPINCOUNT", ENGINE_OMP_SPIN_COUNT)
    env.setdefault("KMP_BLOCKTIME", ENGINE_KMP_BLOCKTIME_MS)
    env.update(child_openmp_env(parent))
    return env
