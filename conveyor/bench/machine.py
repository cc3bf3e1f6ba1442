"""What machine a benchmark ran on, for its figures' titles and its JSON."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """'AMD EPYC 9B45, 2 cores': /proc/cpuinfo's model name (Linux), else what platform knows."""
    name = ""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name or platform.processor() or platform.machine()}, {os.cpu_count() or 1} cores"
