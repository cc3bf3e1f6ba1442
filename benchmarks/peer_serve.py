"""Conveyor's served path against vLLM's server, with vLLM's own client, then the same prompts in process.

Starts `conveyor serve` (defaults, as a new user runs it), runs `vllm bench serve` (benchmarks/vllm_bench_client.py,
from vLLM's venv) at each request rate, stops every process the server started (by pid), then the same for
`vllm serve` (its recommended CPU set-up: tcmalloc and Intel OpenMP preloaded, both cores bound), then the
prompts of the saturation run through `LLM.generate` in this process. One target is loaded at a time; each
rate draws its own prompts (seed + rate index) so no prefix cache carries one rate's prompts to the next. Per
process CPU seconds are read from /proc for every run (benchmarks/proc_cpu.py).

    .venv/bin/python -m benchmarks.peer_serve                                   # ~15 min on 2 cores
    .venv/bin/python -m benchmarks.peer_serve --targets conveyor,inproc --rates inf
    .venv/bin/python -m benchmarks.peer_serve --targets conveyor,vllm,inproc,vllm_inproc --rates inf --rounds 4
    .venv/bin/python -m benchmarks.peer_serve --targets conveyor --conveyor-env RAY_SERVE_THROUGHPUT_OPTIMIZED=0
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from conveyor.serving.config import KV_CACHE_DTYPES  # dataclasses only: neither torch nor ray

ROOT = Path(__file__).resolve().parents[1]
from benchmarks.compare import DEFAULT_VLLM_PYTHON, free_port, vllm_env, wait_http  # noqa: E402
from benchmarks.inproc_peer import run_result_process  # noqa: E402
from benchmarks.proc_cpu import (  # noqa: E402
    NOT_SERVER_ROLES,
    breakdown_table,
    cpu_by_role,
    descendants,
    outside_engine_s,
    server_roles,
    snapshot,
)

RESULTS_DIR = ROOT / "benchmarks" / "results"


def model_dir(model: str) -> str:
    from conveyor.serving.models.loader import resolve_model_path

    return str(resolve_model_path(model))


# ---- servers ------------------------------------------------------------------------------------------
def start_server(name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    log = open(Path(tempfile.gettempdir()) / f"peer_serve_{name}.log", "w")  # noqa: SIM115 - the server's lifetime
    return subprocess.Popen(argv, stdout=log, stderr=log, env=env, start_new_session=True)


def wait_ready(url: str, model: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Up when a short completion succeeds (a /health can answer before the engine has loaded)."""
    wait_http(url + "/health", timeout_s, proc)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # vLLM's server exits once its engine died (e.g. a head size its CPU attention lacks): say so now rather than
        # after the timeout.
        if proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with code {proc.returncode}: see its log in "
                               f"{tempfile.gettempdir()}")
        try:
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url} never completed a request")


def start_conveyor(args: argparse.Namespace, port: int) -> subprocess.Popen:
    env = dict(os.environ)
    for pair in args.conveyor_env:
        key, _, value = pair.partition("=")
        env[key] = value
    argv = [str(ROOT / ".venv" / "bin" / "conveyor"), "serve", "--port", str(port), *args.conveyor_arg]
    if args.dtype != "float32":  # float32 is what `conveyor serve` runs on CPU by default
        argv += ["--dtype", args.dtype]
    if args.kv_cache_dtype != "auto":
        argv += ["--kv-cache-dtype", args.kv_cache_dtype]
    return start_server("conveyor", argv, env)


def start_vllm(args: argparse.Namespace, port: int) -> subprocess.Popen:
    py = args.vllm_python
    env = vllm_env(py, os.cpu_count() or 1)
    # Both servers at one dtype (--dtype: float32 by default, Conveyor's CPU default); everything else at vLLM's
    # defaults.
    argv = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir(args.model), "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", args.model, "--dtype", args.dtype,
            "--max-model-len", "2048", "--disable-uvicorn-access-log", *args.vllm_arg]
    return start_server("vllm", argv, env)


def stop_all(proc: subprocess.Popen, before: set[int]) -> list[int]:
    """SIGINT the server's session, then SIGKILL by pid each of the server's processes still alive: those below it
    when it was stopped and below them since (Ray's raylet and workers, vLLM's EngineCore and worker outlive it,
    re-parented) and those of its session; new since `before`. Only the server's own: the machine is shared, and
    another user's engine or Ray worker has the same command line as ours."""
    tree = descendants({proc.pid})
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    killed: set[int] = set()
    for _ in range(3):
        tree = descendants(tree)
        leftover = [p for p in snapshot() if p not in before and p != os.getpid()
                    and (p in tree or _in_session(p, proc.pid))]
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        if not leftover:
            break
        time.sleep(1.0)
    return sorted(killed)


def _in_session(pid: int, session: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[3]) == session


# ---- the client --------------------------------------------------------------------------------------
def run_client(args: argparse.Namespace, url: str, rate: str, seed: int, tag: str,
               max_concurrency: int | None = None) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="peer_serve_"))
    prompts = out_dir / "prompts.json"
    cmd = [args.vllm_python, str(ROOT / "benchmarks" / "vllm_bench_client.py"), "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", args.model,
           "--tokenizer", model_dir(args.model), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--request-rate", rate, "--seed", str(seed), "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", "result.json",
           "--dump-prompts", str(prompts), "--dump-client-cpu", str(out_dir / "client_cpu.json"),
           "--disable-tqdm", "--save-detailed"]
    if max_concurrency:
        cmd += ["--max-concurrency", str(max_concurrency)]
    if args.temperature > 0:  # vLLM's client sends greedy requests unless told
        cmd += ["--temperature", str(args.temperature), "--top-p", str(args.top_p)]
    before, children_before = snapshot(), _children_cpu_s()
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.client_timeout_s)
    wall = time.monotonic() - started
    cpu = cpu_by_role(before, snapshot())
    cpu["client"] = _children_cpu_s() - children_before  # it has exited: its CPU is in our reaped children
    if done.returncode != 0:
        raise RuntimeError(f"client failed ({tag}, rate {rate}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads((out_dir / "result.json").read_text())
    row = summarize_client(result) | {"target": tag, "rate": rate if not max_concurrency else f"c={max_concurrency}",
                                      "seed": seed, "wall_s": wall, "cpu_s": cpu}
    row["prompts_file"] = str(prompts)
    # The client's CPU while it sent and read (its imports and prompt sampling before are idle time for the server):
    # what it took from the cores the server shares with it.
    row["client_cpu_s_in_run"] = json.loads((out_dir / "client_cpu.json").read_text())["client_cpu_s"]
    return row


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def summarize_client(r: dict) -> dict:
    keys = ("completed", "failed", "duration", "total_output_tokens", "output_throughput", "request_throughput",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
            "median_e2el_ms", "p99_e2el_ms")
    # Each request's TTFT, in the order the client sent them (its arrival order): where a tail comes from.
    ttfts = [round(t * 1000, 1) if t else None for t in r.get("ttfts") or []]
    return {k: r.get(k) for k in keys} | {"ttfts_ms": ttfts}


# ---- in process ------------------------------------------------------------------------------------------
def run_inproc(args: argparse.Namespace, prompts_file: str) -> dict:
    from conveyor.serving import LLM, SamplingParams

    rows = json.loads(Path(prompts_file).read_text())
    # `conveyor serve` defaults: max_num_seqs 64, 512-token budget
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    params = [SamplingParams(max_tokens=r["output_len"], temperature=args.temperature, top_p=args.top_p,
                             ignore_eos=True) for r in rows]
    llm.generate(["Hello"], SamplingParams(max_tokens=4))  # warm-up, as the servers got one
    before = snapshot(client_pids={os.getpid()})
    started = time.monotonic()
    results = llm.generate([r["prompt"] for r in rows], params)
    wall = time.monotonic() - started
    cpu = cpu_by_role(before, snapshot(client_pids={os.getpid()}))
    num_out = sum(len(r.token_ids) for r in results)
    return {"target": "inproc", "rate": "inf", "completed": len(results), "total_output_tokens": num_out,
            "duration": wall, "output_throughput": num_out / wall, "wall_s": wall, "cpu_s": cpu}


def run_vllm_inproc(args: argparse.Namespace, prompts_file: str) -> dict:
    """The same prompts through vLLM's `LLM.generate` with its server's defaults (benchmarks/vllm_inproc.py, in its
    venv, with the server's CPU set-up): the in-process figure for `vllm serve`'s ratio."""
    cmd = [args.vllm_python, str(ROOT / "benchmarks" / "vllm_inproc.py"), "--model-dir", model_dir(args.model),
           "--prompts", prompts_file, "--dtype", args.dtype, "--temperature", str(args.temperature),
           "--top-p", str(args.top_p)]
    r = run_result_process(cmd, vllm_env(args.vllm_python, os.cpu_count() or 1), args.client_timeout_s,
                           "vLLM in process")
    return {"target": "vllm_inproc", "rate": "inf", "completed": r["completed"],
            "total_output_tokens": r["total_output_tokens"], "duration": r["wall_s"],
            "output_throughput": r["total_output_tokens"] / r["wall_s"], "wall_s": r["wall_s"]}


def run_inproc_stream(args: argparse.Namespace, prompts_file: str, rate: str) -> dict:
    """The same prompts on an AsyncEngine in this process (the engine a replica runs, without HTTP or Ray),
    streamed, at the same rate (Poisson arrivals of its own seed): what TTFT and ITL the engine alone gives."""
    import asyncio

    from benchmarks.inproc import make_engine, run_inproc
    from conveyor.bench.metrics import distribution
    from conveyor.bench.workload import BenchRequest, arrival_offsets

    rows = json.loads(Path(prompts_file).read_text())
    engine = make_engine(args.model, max_num_batched_tokens=512, max_num_seqs=64,  # `conveyor serve` defaults
                         dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    try:
        reqs = [BenchRequest(engine.tokenize(r["prompt"]), r["output_len"]) for r in rows]
        asyncio.run(run_inproc(engine, reqs[:1], [0.0]))  # warm-up
        before = snapshot(client_pids={os.getpid()})
        offsets = arrival_offsets(len(reqs), float(rate), seed=args.seed)
        results, wall = asyncio.run(run_inproc(engine, reqs, offsets))
        cpu = cpu_by_role(before, snapshot(client_pids={os.getpid()}))
    finally:
        engine.shutdown()
    done = [r for r in results if r.ok]
    num_out = sum(r.output_tokens for r in done)
    ttft, tpot = distribution([r.ttft for r in done]), distribution([r.tpot for r in done])
    itl = distribution([g for r in done for g in r.itls])
    return {"target": "inproc_stream", "rate": rate, "completed": len(done), "total_output_tokens": num_out,
            "duration": wall, "output_throughput": num_out / wall, "wall_s": wall, "cpu_s": cpu,
            "median_ttft_ms": ttft["p50"], "p99_ttft_ms": ttft["p99"], "median_tpot_ms": tpot["p50"],
            "median_itl_ms": itl["p50"], "p99_itl_ms": itl["p99"]}


# ---- report ----------------------------------------------------------------------------------------------
# Each server's rate-inf throughput is divided by its own engine's on the same prompts in process.
IN_PROCESS_OF = {"conveyor": "inproc", "vllm": "vllm_inproc"}


def served_ratios(rows: list[dict]) -> dict[int, float]:
    """Row index -> that server row's rate-inf throughput over its own engine's in process in the same round."""
    inproc = {(r.get("round"), r["target"]): r["output_throughput"] for r in rows
              if r["target"] in IN_PROCESS_OF.values()}
    ratios = {}
    for i, r in enumerate(rows):
        base = inproc.get((r.get("round"), IN_PROCESS_OF.get(r["target"], "")))
        if base and r["rate"] == "inf":
            ratios[i] = r["output_throughput"] / base
    return ratios


def report(rows: list[dict]) -> str:
    ratios = served_ratios(rows)
    lines = ["| round | target | rate | done | out tok/s | vs in process | TTFT p50 | TTFT p99 | TPOT p50 | ITL p50 "
             "| ITL p99 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        ratio = f"{ratios[i]:.2f}x" if i in ratios else ""
        ms = {k: (f"{r[k] / 1000:.1f} s" if (r.get(k) or 0) >= 1000 else f"{r[k]:.0f} ms") if r.get(k) else ""
              for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms")}
        lines.append(f"| {r.get('round', '')} | {r['target']} | {r['rate']} | {r.get('completed')} "
                     f"| {r['output_throughput']:.1f} | {ratio} "
                     f"| {ms['median_ttft_ms']} | {ms['p99_ttft_ms']} | {ms['median_tpot_ms']} "
                     f"| {ms['median_itl_ms']} | {ms['p99_itl_ms']} |")
    for r in rows:
        if r["rate"] != "inf" or "cpu_s" not in r:  # vllm_inproc: one process that exits before it could be read
            continue
        cpu = r["cpu_s"]
        share = 100 * outside_engine_s(cpu) / max(1e-9, sum(server_roles(cpu).values()))
        machine = sum(v for k, v in cpu.items() if k in NOT_SERVER_ROLES)
        lines += ["", f"CPU by process, {r['target']} at rate inf (server processes outside the engine: "
                  f"{share:.1f}% of the server's CPU; not the server's, not counted: kernel threads and other "
                  f"processes, {machine:.1f} s):", breakdown_table(cpu, r["total_output_tokens"], r["wall_s"])]
        if r.get("client_cpu_s_in_run") is not None:
            run_share = 100 * r["client_cpu_s_in_run"] / (r["duration"] * (os.cpu_count() or 1))
            lines.append(f"The client while it sent and read: {r['client_cpu_s_in_run']:.1f} CPU s, {run_share:.1f}% "
                         f"of the machine over the {r['duration']:.0f} s run.")
    by_target: dict[str, list[float]] = {}
    for i, ratio in ratios.items():
        by_target.setdefault(rows[i]["target"], []).append(ratio)
    for target, values in by_target.items():
        if len(values) > 1:  # one pair moves by +-15% on a small VM: the median of rounds is the figure
            lines.append(f"{target} vs its engine in process over {len(values)} rounds: median "
                         f"{statistics.median(values):.2f}x (range {min(values):.2f}-{max(values):.2f}x)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="conveyor,vllm,inproc")
    p.add_argument("--rates", default="inf,1,0.5", help="request rates (req/s); the first should be inf")
    p.add_argument("--concurrencies", default="", help="instead of rates: closed loops of this many requests in "
                   "flight (vLLM's --max-concurrency), e.g. 1,4: the latency of small batches")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="every target (bfloat16: fast only where the CPU has native bf16)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="Conveyor's targets only (vLLM's server keeps its own KV cache at --dtype)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the servers' and inproc's requests (0: greedy; inproc_stream stays greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0")
    p.add_argument("--conveyor-arg", action="append", default=[], help="extra flag for `conveyor serve`")
    p.add_argument("--conveyor-env", action="append", default=[], help="KEY=VALUE for `conveyor serve`")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra flag for `vllm serve`")
    p.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    p.add_argument("--prompts", default=None, help="in-process targets only: a prompts file an earlier run dumped")
    p.add_argument("--client-timeout-s", type=float, default=900)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every target this many times, in turn; the report gives each server's median ratio")
    p.add_argument("--out", default=str(RESULTS_DIR / "peer_serve.json"))
    args = p.parse_args()
    if not Path(args.vllm_python).exists():
        raise SystemExit(f"{args.vllm_python} missing: run `bash benchmarks/setup_vllm.sh` (vLLM's client is used "
                         "for every target)")
    rows: list[dict] = []
    for round_number in range(1, args.rounds + 1):
        rows += [r | {"round": round_number} for r in run_round(args)]
    text = report(rows)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows,
                               "load_avg_1m_after": os.getloadavg()[0]}, indent=1))
    print(f"wrote {out}")


def run_round(args: argparse.Namespace) -> list[dict]:
    """Every server target at every load, then the in-process targets on the prompts the servers got."""
    targets, rates = args.targets.split(","), args.rates.split(",")
    rows: list[dict] = []
    starters = {"conveyor": start_conveyor, "vllm": start_vllm}
    for target in (t for t in targets if t in starters):
        before, port = set(snapshot()), free_port()
        started = time.monotonic()
        proc = starters[target](args, port)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, args.model, proc, 600)
            print(f"{target} ready in {time.monotonic() - started:.0f} s", flush=True)
            loads = ([("inf", int(c)) for c in args.concurrencies.split(",")] if args.concurrencies
                     else [(rate, None) for rate in rates])
            for i, (rate, concurrency) in enumerate(loads):
                rows.append(run_client(args, url, rate, args.seed + i, target, concurrency))
                print(report(rows[-1:]).split("\n\n")[0], flush=True)
        finally:
            killed = stop_all(proc, before)
            print(f"{target} stopped; killed leftover pids {killed}", flush=True)
            time.sleep(3)
    if {"inproc", "inproc_stream", "vllm_inproc"} & set(targets):
        prompts = args.prompts or next((r["prompts_file"] for r in rows if r["rate"] == "inf"), None)
        if prompts is None:  # the prompts are drawn by vLLM's client during a server's run
            raise SystemExit("in-process targets need the prompts of a server's rate-inf run: add a server target")
    if "inproc" in targets:
        rows.append(run_inproc(args, prompts))
    if "vllm_inproc" in targets:
        rows.append(run_vllm_inproc(args, prompts))
    if "inproc_stream" in targets:
        for rate in rates:
            served = next((r["prompts_file"] for r in rows if r["rate"] == rate and "prompts_file" in r), None)
            rows.append(run_inproc_stream(args, served or prompts, rate))
    return rows


if __name__ == "__main__":
    main()
