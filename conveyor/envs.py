"""Every CONVEYOR_* environment variable: its name, default and meaning, read in one place.

conveyor/serving and conveyor/router read their variables through `get`; docs/configuration.md lists this table.
conveyor/kernels imports nothing of ours, so its build variables are read there and only listed here
(KERNEL_ENV_VARS). Each variable's details live with the code that acts on it (named in `where`).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    meaning: str
    where: str  # the module that acts on it


API_KEY = "CONVEYOR_API_KEY"
CACHE_DIR = "CONVEYOR_CACHE_DIR"
ENGINE_BIND_THREADS = "CONVEYOR_ENGINE_BIND_THREADS"
ENGINE_NICE = "CONVEYOR_ENGINE_NICE"
ENGINE_OPENMP = "CONVEYOR_ENGINE_OPENMP"
GRAMMAR_NICE = "CONVEYOR_GRAMMAR_NICE"
RAY_SCHED_BATCH = "CONVEYOR_RAY_SCHED_BATCH"
SERVE_NO_PROXY = "CONVEYOR_SERVE_NO_PROXY"
STEP_TRACE = "CONVEYOR_STEP_TRACE"

ENV_VARS: dict[str, EnvVar] = {var.name: var for var in (
    EnvVar(API_KEY, "", "`conveyor serve`: the API key clients must send as 'Authorization: Bearer KEY' (safer "
           "than --api-key, which the process list shows)", "conveyor/router/serve_cli.py"),
    EnvVar(CACHE_DIR, "~/.cache/conveyor", "where models are downloaded and converted",
           "conveyor/serving/models/hub.py"),
    EnvVar(ENGINE_BIND_THREADS, "auto", "auto: bind the engine child's OpenMP threads one to a CPU when its team "
           "has a thread for every CPU the process may use; off: leave them to the kernel",
           "conveyor/serving/openmp_runtime.py"),
    EnvVar(ENGINE_NICE, "0", "the engine process's niceness ('': keep the one Ray gave)",
           "conveyor/serving/priority.py"),
    EnvVar(ENGINE_OPENMP, "auto", "the engine child's OpenMP runtime: auto (Intel's when installed, else GNU's), "
           "intel, gnu", "conveyor/serving/openmp_runtime.py"),
    EnvVar(GRAMMAR_NICE, "10", "niceness of the structured-output grammar compile threads",
           "conveyor/serving/grammar.py"),
    EnvVar(RAY_SCHED_BATCH, "1", "`conveyor serve`: 1 starts the local Ray under SCHED_BATCH (the engine process "
           "leaves it), 0 not", "conveyor/serving/priority.py"),
    EnvVar(SERVE_NO_PROXY, "1", "`conveyor serve` without --http-proxy: 1 keeps Serve from starting its HTTP proxy, "
           "which direct ingress leaves unused; 0 lets it start", "conveyor/router/worker_setup.py"),
    EnvVar(STEP_TRACE, "", "a file: append one JSON line per engine step to it (diagnosis)",
           "conveyor/serving/step_trace.py"),
)}

# Read in conveyor/kernels (which imports nothing of ours); listed for the docs only.
KERNEL_ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("CONVEYOR_CPU_BUILD_DIR", "~/.cache/conveyor/cpu_ext/<sources digest>",
           "where the C++ CPU extension is built", "conveyor/kernels/cpu_ext.py"),
    EnvVar("CONVEYOR_CPU_VERBOSE", "", "1: show the CPU extension's compiler output", "conveyor/kernels/cpu_ext.py"),
    EnvVar("CONVEYOR_DISABLE_CPU_EXT", "", "1: do not build or load the CPU extension (the torch paths run)",
           "conveyor/kernels/cpu_ext.py"),
    EnvVar("CONVEYOR_CUDA_BUILD_DIR", "~/.cache/conveyor/cuda_ext", "where the CUDA extension is built",
           "conveyor/kernels/cuda_ext.py"),
    EnvVar("CONVEYOR_CUDA_VERBOSE", "", "1: show the CUDA extension's compiler output", "conveyor/kernels/cuda_ext.py"),
    EnvVar("CONVEYOR_GGUF_EXPAND_MIN_ROWS", "(built in)", "GGUF matmul: the row count from which blocks are expanded "
           "first (A/B runs)", "conveyor/kernels/csrc/cpu/gguf_linear_cpu.cpp"),
)


def get(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The variable's value in `environ` (default: this process's), or its default when unset."""
    return (os.environ if environ is None else environ).get(name, ENV_VARS[name].default)


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Set to a non-empty value."""
    return bool((os.environ if environ is None else environ).get(name))
