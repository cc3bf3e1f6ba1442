"""What an idle `conveyor serve` costs the machine: CPU per process role while nothing is sent.

At saturation this background is paid on top of the per-token path, and on a small CPU machine every
CPU-second another process takes costs the engine's OpenMP team about twice that (its partner thread waits at the
next barrier: benchmarks/RESULTS.md, "Session 9"). Each variant starts the server with extra environment
settings, waits until it answers, samples every process's CPU time for --seconds, and stops every process it
started (by pid) before the next.

    .venv/bin/python benchmarks/idle_cpu.py                                   # the default server, 30 s
    .venv/bin/python benchmarks/idle_cpu.py --variant default= --variant no_prestart=RAY_enable_worker_prestart=0
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.compare import free_port  # noqa: E402
from benchmarks.peer_serve import start_conveyor, stop_all, wait_ready  # noqa: E402
from benchmarks.proc_cpu import NOT_SERVER_ROLES, cpu_by_role, snapshot  # noqa: E402


def measure(name: str, env_pairs: list[str], seconds: float, model: str) -> dict:
    port = free_port()
    before = set(snapshot())
    proc = start_conveyor(argparse.Namespace(conveyor_env=env_pairs, conveyor_arg=[], dtype="float32",
                                              kv_cache_dtype="auto"), port)
    try:
        wait_ready(f"http://127.0.0.1:{port}", model, proc, timeout_s=300)
        time.sleep(5.0)  # start-up work (compiles, first health checks) is not the steady background
        start = snapshot()
        time.sleep(seconds)
        by_role = cpu_by_role(start, snapshot())
    finally:
        stop_all(proc, before)
    by_role.pop("client", None)
    cores = {role: cpu / seconds for role, cpu in sorted(by_role.items(), key=lambda kv: -kv[1])}
    server = sum(v for role, v in cores.items() if role not in NOT_SERVER_ROLES)
    return {"variant": name, "env": env_pairs, "seconds": seconds, "cores": cores, "total_cores": server}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=KEY=VALUE,KEY=VALUE (environment of `conveyor serve`); default: one run as is")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args()
    variants = args.variant or ["default="]
    rows = []
    for spec in variants:
        name, _, pairs = spec.partition("=")
        rows.append(measure(name, [kv for kv in pairs.split(",") if kv], args.seconds, args.model))
        print(f"{name}: {rows[-1]['total_cores']:.3f} cores idle")
    roles = sorted({role for row in rows for role in row["cores"]})
    print("| role | " + " | ".join(row["variant"] for row in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for role in roles:
        print(f"| {role} | " + " | ".join(f"{row['cores'].get(role, 0.0):.3f}" for row in rows) + " |")
    print("| **the server (kernel threads and other processes not counted)** | "
          + " | ".join(f"**{row['total_cores']:.3f}**" for row in rows) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
