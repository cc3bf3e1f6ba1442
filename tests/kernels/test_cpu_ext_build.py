"""Starting a process that loads the CPU extension after a build was killed midway."""
from __future__ import annotations

import subprocess
import sys

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
