"""The CPU KV cache is lazily zeroed memory without MADV_HUGEPAGE: with it, where the kernel compacts memory on a
huge-page fault (THP defrag "madvise"), every first write into a cache block stalled a prefill for milliseconds."""
from __future__ import annotations

import sys

import pytest
import torch

from conveyor.serving.model_runner import zeroed_tensor

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/smaps")


def vm_flags_of(address: int) -> list[str]:
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_cpu_cache_is_zero_and_not_madvised_for_huge_pages() -> None:
    cache = zeroed_tensor((1024, 16, 8, 64), torch.float32, torch.device("cpu"))  # 32 MB: numpy would madvise it
    # numpy madvises from the first 2 MB boundary on: look in the middle, not at the first byte
    assert "hg" not in vm_flags_of(cache.data_ptr() + cache.numel() * cache.element_size() // 2)
    assert not cache[::97].any()
    cache[3] = 1.0  # writable, and the rest stays zero
    assert cache.sum().item() == 16 * 8 * 64
