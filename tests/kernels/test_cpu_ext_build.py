"""Starting a process that loads the CPU extension after a build was killed midway."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conveyor.kernels import cpu_ext
from tests.cpu_ext_gate import require_cpu_ext

LOAD = "from conveyor.kernels import cpu_ext; cpu_ext.load(); print('loaded')"


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start() -> None:
    require_cpu_ext()  # built here first, so the process below only checks it is current
    baton = cpu_ext.build_dir() / "lock"  # what torch's build leaves when it is killed before its end
    baton.touch()
    try:
        # Before the kernel lock, this waited on the baton for ever (a replica's start hung with no message).
        done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300)
    finally:
        existed = baton.exists()
        baton.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loaded" in done.stdout
    assert "left by a build that was killed midway" in done.stderr
    assert not existed


def _checkout(root: Path) -> Path:
    """A copy of the kernel sources as another clone holds them."""
    csrc = root / "csrc"
    csrc.mkdir(parents=True)
    for path in cpu_ext._inputs():
        shutil.copyfile(path, csrc / path.name)
    return csrc


def _point_at(monkeypatch, csrc: Path) -> None:
    monkeypatch.setattr(cpu_ext, "_CSRC", csrc)
    monkeypatch.setattr(cpu_ext, "SOURCES", [csrc / s.name for s in cpu_ext.SOURCES])
    monkeypatch.delenv("CONVEYOR_CPU_BUILD_DIR", raising=False)


def test_clones_with_the_same_sources_share_one_build_folder(tmp_path: Path, monkeypatch) -> None:
    """A fresh clone reuses the build of another checkout (no ~2 min compile), and a changed source or header gets
    a folder of its own rather than rebuilding the shared one."""
    first, second = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    _point_at(monkeypatch, first)
    shared = cpu_ext.build_dir()
    _point_at(monkeypatch, second)
    assert cpu_ext.build_dir() == shared
    header = next(second.glob("*.h"))
    header.write_bytes(header.read_bytes() + b"\n// changed\n")
    assert cpu_ext.build_dir() != shared


def test_another_torch_install_gets_its_own_build_folder(tmp_path: Path, monkeypatch) -> None:
    """build.ninja holds the torch include folders: a clone with its own venv must not rebuild the build of a
    checkout with another (each such switch cost ~3 min)."""
    _point_at(monkeypatch, _checkout(tmp_path / "a"))
    mine = cpu_ext.build_dir()
    monkeypatch.setattr(cpu_ext, "_torch_dir", lambda: str(tmp_path / "other-venv" / "torch"))
    assert cpu_ext.build_dir() != mine


def test_staged_sources_keep_their_mtime_when_unchanged(tmp_path: Path, monkeypatch) -> None:
    """torch compiles the copies in the build folder; an identical copy is left alone (a new mtime would make ninja
    rebuild for every clone), a changed one is rewritten."""
    _point_at(monkeypatch, _checkout(tmp_path / "a"))
    staged = cpu_ext._stage_sources(tmp_path / "build")
    assert [p.name for p in staged] == [s.name for s in cpu_ext.SOURCES] and all(p.exists() for p in staged)
    assert all((tmp_path / "build" / "src" / h.name).exists() for h in cpu_ext._CSRC.glob("*.h"))  # for #include
    os.utime(staged[0], (1_000_000, 1_000_000))
    _point_at(monkeypatch, _checkout(tmp_path / "b"))
    cpu_ext._stage_sources(tmp_path / "build")
    assert staged[0].stat().st_mtime == 1_000_000  # same bytes: untouched
    changed = cpu_ext._CSRC / staged[0].name
    changed.write_bytes(changed.read_bytes() + b"\n// changed\n")
    cpu_ext._stage_sources(tmp_path / "build")
    assert staged[0].read_bytes() == changed.read_bytes()
