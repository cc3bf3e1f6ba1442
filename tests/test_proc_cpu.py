"""The per-process CPU accounting of the served benchmarks (benchmarks/proc_cpu.py)."""
from __future__ import annotations

import os

from benchmarks.proc_cpu import ProcSample, server_cpu, server_cpu_line, snapshot


def _samples(**cpu_by_pid_role: float) -> dict[int, ProcSample]:
    return {pid: ProcSample(pid, role.replace("_", " "), cpu)
            for pid, (role, cpu) in enumerate(cpu_by_pid_role.items())}


def test_the_share_outside_the_engine_leaves_out_the_engine_the_client_and_unmatched_processes() -> None:
    before = _samples(engine_child=10.0, ingress=1.0, replica=1.0, client=5.0, other=0.0)
    after = _samples(engine_child=28.0, ingress=1.4, replica=1.2, client=8.0, other=9.0)
    record = server_cpu(before, after, wall_s=10.0, num_cores=2)
    assert record["cpu_cores"] == {"engine child": 1.8, "other": 0.9, "client": 0.3, "ingress": 0.04,
                                   "replica": 0.02}
    assert record["outside_engine_share"] == 0.03  # 0.6 CPU s of 20 core-seconds
    line = server_cpu_line(record)
    assert "engine child 1.800" in line and "outside its engine: 3.0%" in line


def test_vllms_engine_core_is_its_engine_and_a_process_started_in_the_window_counts_whole() -> None:
    before = _samples(vllm_engine_core=0.0)
    after = {**_samples(vllm_engine_core=15.0), 7: ProcSample(7, "vllm api server", 2.0)}
    record = server_cpu(before, after, wall_s=10.0, num_cores=2)
    assert record["outside_engine_share"] == 0.1


def test_snapshot_names_the_client_by_pid() -> None:
    samples = snapshot({os.getpid()})
    assert samples[os.getpid()].role == "client" and samples[os.getpid()].cpu_s > 0
