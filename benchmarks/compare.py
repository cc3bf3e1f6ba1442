"""Peer comparison on SmolLM2, one run, side by side: starts every target itself, then sweeps request rates
alternating targets (benchmarks/serving/runner.py::compare) and finds each one's capacity at a p99 ITL SLO.

Targets: Conveyor continuous batching and Conveyor static batching (two Ray Serve apps in one local Ray,
same engine settings, 2 torch threads each), and the plain transformers server (benchmarks/hf_server.py,
one request at a time, 2 threads). vLLM is run only if `import vllm` works in this venv; otherwise reported
as not run. Only one target is loaded at a time; idle ones sleep.

    .venv/bin/python benchmarks/compare.py                                  # ~10 minutes on 2 cores
    .venv/bin/python benchmarks/compare.py --request-rates 0.5,1 --num-prompts 20 --targets continuous,hf
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before ray is imported: token auth is on by default
from benchmarks.serving.runner import (  # noqa: E402
    RESULTS_DIR,
    add_workload_args,
    compare,
    ratio_table,
    write_compare,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not up after {timeout_s:.0f}s")


def start_conveyor(kinds: list[str], args: argparse.Namespace) -> dict[str, str]:
    """Deploy one Serve app per scheduling kind under /<kind>; return name -> base URL."""
    import ray
    from ray import serve
    from ray.serve.api import _run

    from conveyor.router.app import ServeArgs, build_app

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    urls = {}
    for kind in kinds:
        cfg = ServeArgs(model=args.model, scheduling=kind, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, torch_num_threads=args.threads)
        _run(build_app(cfg), name=kind, route_prefix=f"/{kind}", _blocking=False)
        urls[kind] = f"http://127.0.0.1:{port}/{kind}"
    deadline = time.monotonic() + 300
    while not all(_app_running(k) for k in kinds):
        if time.monotonic() > deadline:
            raise TimeoutError("Serve apps did not start in 300 s")
        time.sleep(1.0)
    return urls


def _app_running(name: str) -> bool:
    from ray import serve

    app = serve.status().applications.get(name)
    if app is not None and app.status in ("DEPLOY_FAILED", "UNHEALTHY"):
        raise RuntimeError(f"app {name} failed: {app.message}")
    return app is not None and app.status == "RUNNING"


def start_hf(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(Path(tempfile.gettempdir()) / "conveyor_hf_server.log", "w")  # noqa: SIM115 - lives as long as the server
    # Ray starts its workers (the Conveyor replicas) at nice 15 on this host; the baseline gets the same,
    # or it would win every contended core from the engines it is compared with.
    cmd = ["nice", "-n", str(args.nice), sys.executable, str(ROOT / "benchmarks" / "hf_server.py"),
           "--model", args.model, "--port", str(port), "--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 180)
    return proc, url


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="continuous,static,hf")
    p.add_argument("--request-rates", default="0.25,0.5,1,2")
    p.add_argument("--itl-slo-ms", type=float, default=300.0)
    p.add_argument("--max-num-seqs", type=int, default=16, help="both Conveyor apps (static batch size)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="torch threads per target")
    p.add_argument("--nice", type=int, default=15, help="the HF server's niceness (Ray workers run at 15)")
    add_workload_args(p)
    p.set_defaults(num_prompts=30, goodput=["ttft:5000", "itl:300"],
                   out=str(RESULTS_DIR / "compare_smollm2.json"))
    args = p.parse_args()
    wanted = args.targets.split(",")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    vllm_note = ("vllm importable but not wired in this script" if importlib.util.find_spec("vllm")
                 else "not run: vllm is not installed in this venv")
    hf_proc = None
    try:
        targets = start_conveyor([k for k in wanted if k in ("continuous", "static")], args)
        if "hf" in wanted:
            hf_proc, targets["hf"] = start_hf(args)
        targets = {k: targets[k] for k in wanted}  # the first named target is the ratios' numerator
        print(f"targets: {targets}; vllm: {vllm_note}", flush=True)
        started = time.time()
        result = compare(targets, args)
        result |= {"vllm": vllm_note, "load_avg_1m_after": os.getloadavg()[0],
                   "wall_s": time.time() - started}
        print(ratio_table(result))
        print(f"wrote {write_compare(result, args)}")
    finally:
        if hf_proc is not None:
            hf_proc.terminate()
            hf_proc.wait(timeout=10)
        import ray

        if ray.is_initialized():
            from ray import serve

            serve.shutdown()
            ray.shutdown()


if __name__ == "__main__":
    main()
