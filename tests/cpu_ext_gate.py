"""The gate for tests of the C++ CPU extension (the production CPU path): they skip only where it cannot be built
(no C++ compiler or ninja, or CONVEYOR_DISABLE_CPU_EXT=1); where a compiler is present, a failed build fails them,
so a broken kernel source never hides behind a skip."""
from __future__ import annotations

from types import ModuleType

import pytest
import torch

from conveyor.kernels import cpu_ext


def require_cpu_ext(op: str | None = None) -> ModuleType:
    """The built extension (with torch.ops.conveyor_cpu.<op> when op is given); a skip where it cannot be built
    here, a failure where it can but does not. Works at module level and inside a test."""
    reason = cpu_ext.unavailable_reason()
    if reason is not None:
        pytest.skip(f"CPU extension cannot be built here: {reason}", allow_module_level=True)
    try:
        module = cpu_ext.load()
    except RuntimeError as exc:
        pytest.fail(f"the CPU extension fails to build although a C++ compiler is here: {exc}", pytrace=False)
    if op is not None and not hasattr(torch.ops.conveyor_cpu, op):
        pytest.fail(f"the CPU extension built but registers no torch.ops.conveyor_cpu.{op}", pytrace=False)
    return module


def cpu_ext_expected() -> bool:
    """Whether this machine can build the extension, so a test list should include the "cpu" backend (a failed
    build then fails those tests rather than dropping them)."""
    return cpu_ext.unavailable_reason() is None
