"""The CUDA sources compile with plain nvcc (no torch headers) for Ampere and Hopper."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.slow  # nvcc takes ~15 s: out of `make test-fast`

CSRC = pathlib.Path(__file__).resolve().parents[2] / "conveyor" / "kernels" / "csrc"
NVCC = shutil.which("nvcc")


ARCHS = ("sm_80", "sm_90")


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_paged_attention_cu_compiles(tmp_path: pathlib.Path) -> None:
    """One nvcc call for both architectures, compiled in parallel (-t): half the wall time of one call each."""
    obj = tmp_path / "paged_attention.o"
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in ARCHS]
    cmd = [NVCC, *gencode, "-t", str(len(ARCHS)), "-O3", "-std=c++17", "-Xptxas", "-v", "-c",
           str(CSRC / "paged_attention.cu"), "-o", str(obj)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert obj.stat().st_size > 0
    lines = result.stderr.splitlines()
    assert all(any(f"for '{arch}'" in line for line in lines) for arch in ARCHS), "ptxas reported no kernels"
    # Register spills would put the per-lane softmax state in local memory: slow, and a sign of a bad variant.
    spills = [line for line in lines if "spill" in line and " 0 bytes spill stores" not in line]
    assert not spills, spills[:5]


def test_header_is_plain_c() -> None:
    """binding.cpp is the only file that may include torch."""
    for name in ("paged_attention.cu", "paged_attention.h"):
        text = (CSRC / name).read_text()
        includes = [line for line in text.splitlines() if line.lstrip().startswith("#include")]
        assert not any("torch" in line or "ATen" in line or "c10" in line for line in includes), name
