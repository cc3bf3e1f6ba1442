"""CPU seconds per process role over a benchmark window, read from /proc (Linux), for the serving-path breakdown.

    before = snapshot(client_pids={os.getpid()})
    ... run the load ...
    by_role = cpu_by_role(before, snapshot(client_pids={os.getpid()}))   # {"engine child": 51.2, "ingress": 3.1, ...}

A process is put in a role by its command line (Ray sets a worker's to `ray::<actor class>...`). A process that
started inside the window counts with all its CPU time; one that ended inside it counts up to its last snapshot.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# (substring of the command line, role): the first match wins, so specific patterns come first.
ROLES: tuple[tuple[str, str], ...] = (
    ("conveyor.serving.engine_core_loop", "engine child"),
    ("conveyor serve", "serve driver"),
    ("EngineReplica", "replica"),
    ("Ingress", "ingress"),
    ("ProxyActor", "serve proxy"),
    ("haproxy", "haproxy"),
    ("ServeController", "serve controller"),
    ("EngineCore", "vllm engine core"),
    ("VLLM::", "vllm engine core"),
    ("vllm.entrypoints", "vllm api server"),
    ("raylet", "ray system"),
    ("gcs_server", "ray system"),
    ("ray/_private", "ray system"),
    ("ray/dashboard", "ray system"),
    ("ray/autoscaler", "ray system"),
    ("ray::", "ray other workers"),
    ("default_worker.py", "ray other workers"),
)

# Not the server's: the kernel's own threads (on these VMs kdamond, the kernel's memory-access monitor, takes
# ~0.015 cores whatever runs) and every process no role matches (this machine's tooling, shells).
KERNEL_ROLE = "kernel threads"
CLIENT_ROLE = "client"  # the load generator's processes (snapshot's client_pids)
OTHER_ROLE = "other"
NOT_SERVER_ROLES = frozenset({KERNEL_ROLE, OTHER_ROLE})
PF_KTHREAD = 0x00200000  # /proc/PID/stat "flags": a kernel thread


@dataclass(frozen=True)
class ProcSample:
    pid: int
    role: str
    cpu_s: float


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()  # the name may hold spaces: split after its closing paren


def _cpu_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def _is_kernel_thread(fields: list[str]) -> bool:
    return bool(int(fields[6]) & PF_KTHREAD)


def role_of(cmdline: str) -> str:
    for needle, role in ROLES:
        if needle in cmdline:
            return role
    return OTHER_ROLE


def snapshot(client_pids: set[int] = frozenset()) -> dict[int, ProcSample]:
    """Every process's CPU time now; `client_pids` (the load generator) get the role "client"."""
    samples = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        fields = _stat_fields(pid)
        if fields is None:
            continue
        if pid in client_pids:
            role = CLIENT_ROLE
        elif _is_kernel_thread(fields):
            role = KERNEL_ROLE
        else:
            role = role_of(cmdline(pid))
        samples[pid] = ProcSample(pid, role, _cpu_s(fields))
    return samples


def parent_pids() -> dict[int, int]:
    """pid -> parent pid of every process now."""
    parents = {}
    for entry in os.listdir("/proc"):
        fields = _stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None:
            parents[int(entry)] = int(fields[1])
    return parents


def descendants(roots: set[int]) -> set[int]:
    """The roots and every process below them now (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_pids().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(roots), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def cpu_by_role(before: dict[int, ProcSample], after: dict[int, ProcSample]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for pid, sample in after.items():
        start = before[pid].cpu_s if pid in before else 0.0
        totals[sample.role] = totals.get(sample.role, 0.0) + max(0.0, sample.cpu_s - start)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def breakdown_table(by_role: dict[str, float], num_output_tokens: int, wall_s: float) -> str:
    """Markdown: per role, CPU seconds, CPU s per 1,000 output tokens, share of all CPU, mean cores busy."""
    total = sum(by_role.values()) or 1.0
    per_k = 1000.0 / max(1, num_output_tokens)
    rows = ["| process | CPU s | CPU s / 1k out tok | share | cores |", "|---|---|---|---|---|"]
    for role, cpu in by_role.items():
        if cpu < 0.05:
            continue
        rows.append(f"| {role} | {cpu:.1f} | {cpu * per_k:.2f} | {100 * cpu / total:.1f}% | {cpu / wall_s:.2f} |")
    rows.append(f"| total | {total:.1f} | {total * per_k:.2f} | 100% | {total / wall_s:.2f} |")
    return "\n".join(rows)


# The processes that compute a server's steps; the rest of its roles are its serving path (HTTP, routing, the
# replica, Ray's and Serve's own processes): what issue 38 bounds at 5% of the machine at saturation.
ENGINE_ROLES = frozenset({"engine child", "vllm engine core"})


def server_roles(by_role: dict[str, float]) -> dict[str, float]:
    """The server's own roles of a cpu_by_role result: neither the client nor what no role matches."""
    return {role: cpu for role, cpu in by_role.items() if role != CLIENT_ROLE and role not in NOT_SERVER_ROLES}


def outside_engine_s(by_role: dict[str, float]) -> float:
    """CPU seconds of the server's roles but its engine's."""
    return sum(cpu for role, cpu in server_roles(by_role).items() if role not in ENGINE_ROLES)


def server_cpu(before: dict[int, ProcSample], after: dict[int, ProcSample], wall_s: float,
               num_cores: int) -> dict:
    """Per role, the mean cores busy over wall_s; and the share of the machine's cores the server spent outside its
    engine (neither the client's CPU nor processes no role matches count)."""
    by_role = cpu_by_role(before, after)
    outside = outside_engine_s(by_role)
    return {"cpu_cores": {role: round(cpu / wall_s, 4) for role, cpu in by_role.items()},
            "outside_engine_share": round(outside / (wall_s * num_cores), 4)}


def server_cpu_line(record: dict, min_cores: float = 0.005) -> str:
    """One line for a server_cpu record: the roles' cores, then the share outside the engine."""
    roles = ", ".join(f"{role} {cores:.3f}" for role, cores in record["cpu_cores"].items() if cores >= min_cores)
    return f"  CPU, cores: {roles}; the server outside its engine: {100 * record['outside_engine_share']:.1f}%"
