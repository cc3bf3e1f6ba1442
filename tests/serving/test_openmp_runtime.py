"""The engine child's OpenMP runtime: Intel's preloaded when it is installed and asked for, GNU's otherwise."""
from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.serving import openmp_runtime
from conveyor.serving.openmp_runtime import OPENMP_ENV, child_openmp_env, engine_child_env

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


def test_conveyor_serve_refuses_a_bad_choice_before_ray_starts():
    import os
    import subprocess
    import sys

    env = os.environ | {OPENMP_ENV: "llvm"}
    done = subprocess.run([sys.executable, "-m", "conveyor.cli", "serve"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "CONVEYOR_ENGINE_OPENMP='llvm': expected one of auto, intel, gnu" in done.stderr
