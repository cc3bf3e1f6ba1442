"""The engine child's OpenMP runtime: Intel's preloaded when it is installed and asked for, GNU's otherwise."""
from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.serving import openmp_runtime
from conveyor.serving.openmp_runtime import (
    BIND_ENV,
    OPENMP_ENV,
    child_openmp_env,
    engine_child_env,
    thread_binding_env,
)

FAKE_IOMP = Path("/opt/env/lib/libiomp5.so")


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(openmp_runtime, "intel_openmp_library", lambda: FAKE_IOMP)


@pytest.fixture
def missing(monkeypatch):
    monkeypatch.setattr(openmp_runtime, "intel_openmp_library", lambda: None)


def test_auto_preloads_intel_s_runtime_ahead_of_what_the_parent_preloads(installed):
    assert child_openmp_env({}) == {"LD_PRELOAD": str(FAKE_IOMP)}
    assert child_openmp_env({OPENMP_ENV: "auto", "LD_PRELOAD": "/x/libjemalloc.so"}) == {
        "LD_PRELOAD": f"{FAKE_IOMP}:/x/libjemalloc.so"}


def test_gnu_and_a_runtime_the_user_preloaded_are_left_alone(installed):
    assert child_openmp_env({OPENMP_ENV: "gnu"}) == {}
    assert child_openmp_env({"LD_PRELOAD": "/torch/lib/libgomp-a34b3233.so.1"}) == {}


def test_without_the_library_auto_falls_back_and_intel_is_an_error(missing):
    assert child_openmp_env({}) == {}
    with pytest.raises(ValueError, match="pip install intel-openmp"):
        child_openmp_env({OPENMP_ENV: "intel"})


def test_an_unknown_choice_is_an_error(installed):
    with pytest.raises(ValueError, match="auto, intel, gnu"):
        child_openmp_env({OPENMP_ENV: "llvm"})


def test_the_child_env_carries_the_choice_and_keeps_the_parent_s(installed):
    env = engine_child_env({"PATH": "/bin", "LD_PRELOAD": "/x/libjemalloc.so"})
    assert env["PATH"] == "/bin" and env["LD_PRELOAD"] == f"{FAKE_IOMP}:/x/libjemalloc.so"
    assert "LD_PRELOAD" not in engine_child_env({OPENMP_ENV: "gnu"})


INTEL = {"LD_PRELOAD": f"{FAKE_IOMP}:/x/libjemalloc.so"}


def test_a_team_with_a_thread_for_every_cpu_is_bound_one_thread_to_a_cpu_in_order():
    assert thread_binding_env(INTEL, 2, {3, 1}) == {"KMP_AFFINITY": "granularity=fine,explicit,proclist=[1,3]"}
    assert thread_binding_env({}, 3, [0, 1, 2]) == {"GOMP_CPU_AFFINITY": "0 1 2"}
    # torch reads OMP_NUM_THREADS when it is given no count: so does the binding (a nested list's first level)
    assert thread_binding_env({"OMP_NUM_THREADS": "2"}, None, {0, 1}) == {"GOMP_CPU_AFFINITY": "0 1"}
    assert thread_binding_env({"OMP_NUM_THREADS": "2,1"}, None, {0, 1}) == {"GOMP_CPU_AFFINITY": "0 1"}


@pytest.mark.parametrize(("env", "num_threads", "cpus"), [
    ({}, 1, {0, 1}),  # a team smaller than the CPUs shares them with other engines: binding would pile them up
    ({}, 1, {0}),  # one thread on one CPU: nothing to keep apart
    ({}, None, {0, 1}),  # no count known
    ({"OMP_NUM_THREADS": "auto"}, None, {0, 1}),
    ({BIND_ENV: "off"}, 2, {0, 1}),
    ({"OMP_PROC_BIND": "false"}, 2, {0, 1}),  # the user's own binding (or none) wins
    ({"KMP_AFFINITY": "disabled"}, 2, {0, 1}),
    ({"GOMP_CPU_AFFINITY": "1 0"}, 2, {0, 1}),
    ({"OMP_PLACES": "cores"}, 2, {0, 1}),
])
def test_nothing_is_bound_otherwise(env, num_threads, cpus):
    assert thread_binding_env(env, num_threads, cpus) == {}


def test_an_unknown_binding_choice_is_an_error():
    with pytest.raises(ValueError, match="auto, off"):
        thread_binding_env({BIND_ENV: "on"}, 2, {0, 1})


def test_the_child_env_binds_the_team_it_is_told_of(installed, monkeypatch):
    monkeypatch.setattr(openmp_runtime.os, "sched_getaffinity", lambda pid: {0, 1})
    assert engine_child_env({}, 2)["KMP_AFFINITY"] == "granularity=fine,explicit,proclist=[0,1]"
    assert engine_child_env({OPENMP_ENV: "gnu"}, 2)["GOMP_CPU_AFFINITY"] == "0 1"
    assert not {"KMP_AFFINITY", "GOMP_CPU_AFFINITY"} & set(engine_child_env({}, 1))


@pytest.mark.parametrize(("var", "value", "message"), [
    (OPENMP_ENV, "llvm", "CONVEYOR_ENGINE_OPENMP='llvm': expected one of auto, intel, gnu"),
    (BIND_ENV, "on", "CONVEYOR_ENGINE_BIND_THREADS='on': expected one of auto, off"),
])
def test_conveyor_serve_refuses_a_bad_choice_before_ray_starts(var, value, message):
    import os
    import subprocess
    import sys

    env = os.environ | {var: value}
    done = subprocess.run([sys.executable, "-m", "conveyor.cli", "serve"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert message in done.stderr
