"""Goodput side by side: SLO attainment and goodput per offered rate, for `conveyor serve` (continuous batching),
`conveyor serve --scheduling static` and `vllm serve`, in one run (issue 38).

Each target's server is started alone (peer_serve.py's starters: `conveyor serve` at its defaults; `vllm serve` from
.vllm-venv with its recommended CPU set-up), then the open-loop Poisson sweep of `conveyor bench` runs against it
(conveyor/bench/runner.py::run_point): per rate, --warmup-s seconds of load at that rate left out of the statistics,
then --num-prompts measured requests; the lognormal workload (prompts median 163 / mean 210 tokens, outputs median
48 / mean 68), greedy, ignore_eos, random token-id prompts drawn afresh for every rate point (the same ones for every
target), so no point is served from an earlier point's prefix cache. Then the server is stopped by the pid of every
process it started, and the next target starts. Per rate and target: attainment (requests meeting every --goodput
SLO, over every request sent: a 429 misses, with its 95% Wilson interval; and over the admitted ones), goodput,
refusals, TTFT/TPOT/ITL/E2E percentiles, output tok/s; capacity = the highest rate with >= 90% attainment (and every
lower rate too). For each served point also the CPU by process over it (benchmarks/proc_cpu.py: mean cores busy per
role, `cpu_cores`) and the share of the machine the server spent outside its engine (`outside_engine_share`:
ingress, replica, Ray and Serve for `conveyor serve`; vLLM's API server for `vllm serve`), printed under its row.

Target `inproc`: the conveyor target's engine (its settings, --conveyor-args included) driven in this process
(AsyncEngine: no HTTP, Ray or engine process) through the same points: the gap to `conveyor` is what the serving
path costs under the SLO. Put it last: it loads torch into this process.

--cross-check-vllm-client RATE: after a target's sweep, our client and vLLM's own (`vllm bench serve --goodput`,
benchmarks/vllm_bench_client.py) each run RATE against the same server, on prompts of the same distribution (their
own token-id prompts, so neither is served from the other's cache), without the warm-up window (vLLM's client has
none), and both goodput figures are printed side by side.

Writes a JSON, a goodput PNG (attainment and goodput against the offered rate) and a latency PNG to --out (default:
bench_results/goodput_<time>.json in the working directory, git-ignored). Run from the repository root:

    .venv/bin/python -m benchmarks.goodput                                     # 3 targets x 5 rates: ~45 min on 2 cores
    .venv/bin/python -m benchmarks.goodput --targets conveyor --rates 1 --num-prompts 10 --warmup-s 2   # smoke, ~1 min
    .venv/bin/python -m benchmarks.goodput --targets conveyor,vllm --rates 3,4,5 --cross-check-vllm-client 3
    .venv/bin/python -m benchmarks.goodput --targets conveyor --conveyor-args "--max-num-batched-tokens 2048"
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.bench.cli_args import add_workload_args, positive_float, rates_arg
from conveyor.bench.machine import cpu_model
from conveyor.bench.metrics import SLO_KEYS, parse_goodput
from conveyor.bench.plots import plot_curves, plot_goodput
from conveyor.bench.report import attainment_capacity, goodput_row, goodput_table
from conveyor.bench.runner import args_record, check_args, plan_point, plot_title, run_point, want_plots

try:
    from benchmarks.compare import DEFAULT_VLLM_PYTHON, free_port
    from benchmarks.peer_serve import model_dir, snapshot, start_conveyor, start_vllm, stop_all, wait_ready
    from benchmarks.proc_cpu import server_cpu, server_cpu_line
except ModuleNotFoundError as exc:  # run as a file, the repository root is not on sys.path
    raise SystemExit("run it from the repository root: .venv/bin/python -m benchmarks.goodput") from exc

TARGETS = ("conveyor", "static", "vllm", "inproc")
VLLM_SLO_KEYS = ("ttft", "tpot", "e2el")  # what vLLM's client accepts (itl is ours)


@dataclass
class TargetRun:
    """One target's sweep: a summary per rate, and the cross-check, if asked for."""
    name: str
    startup_s: float = 0.0
    rows: list[dict] = field(default_factory=list)
    cross_check: dict | None = None
    killed_pids: list[int] = field(default_factory=list)
    error: str = ""  # why the target's server did not start or serve; the other targets still run


def targets_arg(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"bad --targets {text!r}: distinct names from {', '.join(TARGETS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", type=targets_arg, default="conveyor,static,vllm",
                   help=f"comma list from {', '.join(TARGETS)}, run in this order, one server at a time")
    p.add_argument("--rates", dest="request_rates", type=rates_arg, default="2,3,4,5,6",
                   help="offered rates (req/s), open-loop Poisson (--burstiness 1)")
    p.add_argument("--conveyor-args", default="", help="extra flags for the conveyor target's `conveyor serve`, "
                   "one shell-quoted string, e.g. \"--max-num-batched-tokens 2048\"")
    p.add_argument("--static-args", default="", help="extra flags for the static target's `conveyor serve "
                   "--scheduling static`")
    p.add_argument("--vllm-args", default="", help="extra flags for `vllm serve` (python -m "
                   "vllm.entrypoints.openai.api_server)")
    p.add_argument("--conveyor-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for both Conveyor targets")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="every target")
    p.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON), help="(bash benchmarks/setup_vllm.sh)")
    p.add_argument("--startup-timeout-s", type=positive_float, default=900.0)
    p.add_argument("--cross-check-vllm-client", type=positive_float, default=None, metavar="RATE",
                   help="after each target's sweep, our client and vLLM's `--goodput` at RATE, side by side")
    add_workload_args(p)
    p.set_defaults(dataset="lognormal", num_prompts=200, warmup_s=30.0, goodput=["ttft:2000", "tpot:100"])
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = check_args(parser, parser.parse_args(argv))
    if not args.goodput:
        parser.error("--goodput: at least one SLO (goodput is what this measures)")
    needs_vllm = "vllm" in args.targets or args.cross_check_vllm_client
    if needs_vllm and not Path(args.vllm_python).exists():
        parser.error(f"{args.vllm_python} missing: run `bash benchmarks/setup_vllm.sh`, or leave out the vllm "
                     "target and --cross-check-vllm-client")
    return args


# ---- one target --------------------------------------------------------------------------------------
def server_settings(args: argparse.Namespace, target: str) -> argparse.Namespace:
    """The fields peer_serve's starters read, for one target."""
    extra = shlex.split(getattr(args, f"{target}_args"))
    if target == "static":
        extra = ["--scheduling", "static", *extra]
    return argparse.Namespace(model=args.model, dtype=args.dtype, kv_cache_dtype="auto",
                              conveyor_env=args.conveyor_env, conveyor_arg=extra, vllm_python=args.vllm_python,
                              vllm_arg=extra)


def inproc_engine_config(args: argparse.Namespace):  # noqa: ANN201 - EngineConfig, imported late (torch)
    """The engine a `conveyor serve` replica would run with --conveyor-args, from the same parsers and ServeArgs."""
    from conveyor.cli import _add_engine_args
    from conveyor.router.app import ServeArgs
    from conveyor.router.serve_cli import add_serve_args, serve_args_from

    parser = argparse.ArgumentParser()
    _add_engine_args(parser)
    add_serve_args(parser)
    flags = parser.parse_args(["--dtype", args.dtype, *shlex.split(args.conveyor_args)])
    return ServeArgs.model_validate(serve_args_from(flags, parser) | {"model": args.model}).engine_config()


def run_inproc_target(args: argparse.Namespace) -> TargetRun:
    """The conveyor target's engine (AsyncEngine, its settings) in this process, no HTTP, Ray or engine process:
    the same points, so the gap to the served rows is what the serving path costs under the SLO."""
    import asyncio

    from benchmarks.inproc import run_inproc
    from conveyor.bench.metrics import summarize
    from conveyor.bench.runner import measured_window
    from conveyor.serving.async_engine import AsyncEngine

    run = TargetRun("inproc")
    started = time.monotonic()
    engine = AsyncEngine.from_config(inproc_engine_config(args))
    run.startup_s = time.monotonic() - started
    try:
        for i, rate in enumerate(args.request_rates):
            plan = plan_point(args, rate, i)
            results, _ = asyncio.run(run_inproc(engine, plan.requests, plan.offsets, args.max_concurrency))
            measured, duration = measured_window(plan, results)
            summary = summarize(measured, duration, rate, parse_goodput(args.goodput))
            run.rows.append(summary)
            print(goodput_row("inproc", summary), flush=True)
    finally:
        engine.shutdown()
    return run


def run_target(args: argparse.Namespace, target: str) -> TargetRun:
    """Start the target's server alone, sweep the rates (and the cross-check), stop every process it started."""
    if target == "inproc":
        return run_inproc_target(args)
    run = TargetRun(target)
    before, port = set(snapshot()), free_port()
    starter = start_vllm if target == "vllm" else start_conveyor
    started = time.monotonic()
    proc = starter(server_settings(args, target), port)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(url, args.model, proc, args.startup_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            log = Path(tempfile.gettempdir()) / f"peer_serve_{'vllm' if target == 'vllm' else 'conveyor'}.log"
            run.error = f"{exc} (its log: {log})"
            print(f"{target} did not start: {run.error}", flush=True)
            return run
        run.startup_s = time.monotonic() - started
        print(f"{target} ready in {run.startup_s:.0f} s at {url}", flush=True)
        for i, rate in enumerate(args.request_rates):
            cpu_before, point_started = snapshot({os.getpid()}), time.monotonic()
            summary, _ = run_point(url, args, rate, f"{target} @ {rate:g}", i)
            summary |= server_cpu(cpu_before, snapshot({os.getpid()}), time.monotonic() - point_started,
                                  os.cpu_count() or 1)
            run.rows.append(summary)
            print(goodput_row(target, summary), flush=True)
            print(server_cpu_line(summary), flush=True)
        if args.cross_check_vllm_client:
            try:
                run.cross_check = cross_check(args, url, args.cross_check_vllm_client)
                print(cross_check_table(target, run.cross_check), flush=True)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:  # the sweep's figures still count
                run.cross_check = {"error": str(exc)[-2000:]}
                print(f"cross-check on {target} failed: {exc}", flush=True)
    finally:
        run.killed_pids = stop_all(proc, before)
        print(f"{target} stopped; killed leftover pids {run.killed_pids}", flush=True)
        time.sleep(3)  # let the cores go quiet before the next server starts
    return run


# ---- the cross-check with vLLM's client --------------------------------------------------------------
def cross_check(args: argparse.Namespace, url: str, rate: float) -> dict:
    """Our client, then vLLM's, at `rate` on the same server, each on prompts of its own (point indexes past the
    sweep's), no warm-up window: vLLM's client has none."""
    plain = copy.copy(args)
    plain.warmup_s = 0.0
    index = len(args.request_rates)
    ours, _ = run_point(url, plain, rate, f"cross-check ours @ {rate:g}", index)
    theirs = run_vllm_client(args, url, rate, plan_point(plain, rate, index + 1).requests)
    return {"rate": rate, "ours": ours, "vllm_client": theirs}


def run_vllm_client(args: argparse.Namespace, url: str, rate: float, requests: list) -> dict:
    """vLLM's client (benchmarks/vllm_bench_client.py) sending exactly these token-id prompts at `rate`."""
    out_dir = Path(tempfile.mkdtemp(prefix="goodput_vllm_client_"))
    prompts = out_dir / "prompts.json"
    prompts.write_text(json.dumps([{"prompt_token_ids": r.prompt_token_ids, "output_len": r.max_tokens}
                                   for r in requests]))
    slo = [s for s in args.goodput if s.partition(":")[0] in VLLM_SLO_KEYS]
    cmd = [args.vllm_python, str(Path(__file__).with_name("vllm_bench_client.py")), "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", args.model,
           "--tokenizer", model_dir(args.model), "--dataset-name", "random", "--token-prompts", str(prompts),
           "--num-prompts", str(len(requests)), "--request-rate", str(rate), "--seed", str(args.seed),
           "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", "result.json", "--disable-tqdm", *(["--goodput", *slo] if slo else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s + 600)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's client failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads((out_dir / "result.json").read_text())
    keys = ("completed", "failed", "duration", "request_goodput", "output_throughput", "total_input_tokens",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")
    row = {k: result.get(k) for k in keys} | {"num_prompts": len(requests), "goodput_slo": slo}
    good = (result.get("request_goodput") or 0.0) * (result.get("duration") or 0.0)
    row["attainment"] = good / len(requests) if requests else float("nan")
    return row


def cross_check_table(target: str, check: dict) -> str:
    ours, theirs = check["ours"], check["vllm_client"]
    rows = [("goodput (req/s)", ours.get("goodput"), theirs["request_goodput"]),
            ("attainment (%)", 100 * ours.get("attainment", float("nan")), 100 * theirs["attainment"]),
            ("completed", ours["completed"], theirs["completed"]),
            ("TTFT p50 / p99 (ms)", f"{ours['ttft_ms']['p50']:.0f} / {ours['ttft_ms']['p99']:.0f}",
             f"{theirs['median_ttft_ms']:.0f} / {theirs['p99_ttft_ms']:.0f}"),
            ("TPOT p50 / p99 (ms)", f"{ours['tpot_ms']['p50']:.0f} / {ours['tpot_ms']['p99']:.0f}",
             f"{theirs['median_tpot_ms']:.0f} / {theirs['p99_tpot_ms']:.0f}"),
            ("output tok/s", ours["output_throughput"], theirs["output_throughput"])]
    lines = [f"cross-check on {target} at {check['rate']:g} req/s, no warm-up window, SLO {theirs['goodput_slo']}:",
             "| | conveyor bench | vLLM's client |", "|---|---|---|"]
    for name, a, b in rows:
        lines.append(f"| {name} | {_cell(a)} | {_cell(b)} |")
    return "\n".join(lines)


def _cell(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


# ---- the run -----------------------------------------------------------------------------------------
def default_out() -> Path:
    """In the working directory's bench_results/ (git-ignored, as `conveyor bench`'s): a run writes no tracked file."""
    return Path("bench_results") / f"goodput_{time.strftime('%Y%m%d_%H%M%S')}.json"


def out_path(args: argparse.Namespace) -> Path:
    path = Path(args.out) if args.out else default_out()
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_results(args: argparse.Namespace, runs: list[TargetRun], path: Path) -> None:
    per_target = {r.name: r.rows for r in runs}
    record = {"args": args_record(args), "date": time.strftime("%Y-%m-%d %H:%M"), "machine": cpu_model(),
              "goodput_slo": parse_goodput(args.goodput),
              "capacity": {r.name: attainment_capacity(r.rows) for r in runs},
              "startup_s": {r.name: r.startup_s for r in runs}, "errors": {r.name: r.error for r in runs if r.error},
              "per_target": per_target,
              "cross_check": {r.name: r.cross_check for r in runs if r.cross_check}}
    path.write_text(json.dumps(record, indent=1))
    if want_plots(args):
        plot_goodput(per_target, path.with_name(path.stem + "_goodput.png"), plot_title(list(per_target), args.model),
                     parse_goodput(args.goodput))
        plot_curves(per_target, path.with_name(path.stem + "_latency.png"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = out_path(args)  # before the servers: a bad --out fails now, not after an hour
    runs = []
    for target in args.targets:
        runs.append(run_target(args, target))
        write_results(args, runs, path)  # after every target: a later failure keeps what was measured
    print(goodput_table({r.name: r.rows for r in runs}))
    for run in runs:
        if run.cross_check and "error" not in run.cross_check:
            print(cross_check_table(run.name, run.cross_check))
        if run.error:
            print(f"{run.name}: not measured: {run.error}")
    print(f"wrote {path} (SLO keys: {', '.join(k for k in SLO_KEYS if k in parse_goodput(args.goodput))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
