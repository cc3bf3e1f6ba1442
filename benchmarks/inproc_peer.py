"""The engine in process against vLLM's in process (`LLM.generate`), side by side on the same prompts.

Each (system, max batch) runs in a fresh process: Conveyor from this venv, vLLM from its own
(`bash benchmarks/setup_vllm.sh`) with its recommended CPU set-up (tcmalloc and Intel OpenMP preloaded, threads
bound to the cores; compare.vllm_env). Greedy, ignore_eos, long-tailed lengths (workload.py). Besides output tok/s
it prints the achieved FLOP/s on the work of every processed token (linear layers, LM head for sampled tokens,
attention) against an fp32 GEMM timed in the same run, the issue-13 efficiency figure.

    .venv/bin/python -m benchmarks.inproc_peer                               # max batch 1 and 64, ~10 min
    .venv/bin/python -m benchmarks.inproc_peer --max-num-seqs 64 --systems conveyor --json out.json
    .venv/bin/python -m benchmarks.inproc_peer --systems conveyor,conveyor-async    # async scheduling A/B
    .venv/bin/python -m benchmarks.inproc_peer --systems conveyor,conveyor-python   # the C++ decode stack A/B
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"


def make_workload(spec: str, num_requests: int, seed: int) -> list:
    """"long-tail" (workload.py), or "fixed:IN:OUT": every request IN prompt tokens and OUT output tokens, so a
    batch of num_requests stays full from start to end (the engine's steady state)."""
    import random

    from benchmarks.workload import WorkItem, long_tail_workload

    if spec == "long-tail":
        return long_tail_workload(num_requests, seed=seed)
    _, input_len, output_len = spec.split(":")
    rng = random.Random(seed)
    return [WorkItem([rng.randrange(100, 49_000) for _ in range(int(input_len))], int(output_len))
            for _ in range(num_requests)]


def worker(system: str, model_dir: str, max_num_seqs: int, num_requests: int, seed: int,
           workload: str = "long-tail", dtype: str = "float32", kv_cache_dtype: str = "auto") -> dict:
    """Runs inside the measured process: only the system under test and workload.py are imported."""
    items = make_workload(workload, num_requests, seed)
    prompts = [i.prompt_token_ids for i in items]
    if system == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model_dir, dtype=dtype, max_model_len=2048, max_num_seqs=max_num_seqs, seed=0)
        params = [SamplingParams(max_tokens=i.max_tokens, temperature=0.0, ignore_eos=True) for i in items]

        def run(ps: list, sps: list) -> list[int]:
            out = llm.generate([{"prompt_token_ids": p} for p in ps], sps, use_tqdm=False)
            return [len(o.outputs[0].token_ids) for o in out]
    else:
        from conveyor.serving import LLM, SamplingParams

        # "conveyor-async": the same engine with async scheduling (serving/step_pipeline.py); "conveyor-python":
        # decode steps layer by layer from Python rather than in one C++ call (models/decode_stack.py)
        llm = LLM(model_dir, max_num_seqs=max_num_seqs, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                  async_scheduling=system == "conveyor-async", cpu_decode_stack=system != "conveyor-python")
        params = [SamplingParams(max_tokens=i.max_tokens, temperature=0.0, ignore_eos=True) for i in items]

        def run(ps: list, sps: list) -> list[int]:
            return [len(r.token_ids) for r in llm.generate(ps, sps)]

    # Warm-up on prompts of their own: on the measured ones, both prefix caches served two prompts from the cache.
    warm = [i.prompt_token_ids for i in make_workload(workload, 2, seed + 1)]
    run(warm, [type(params[0])(max_tokens=4, temperature=0.0, ignore_eos=True)] * 2)
    start = time.perf_counter()
    lengths = run(prompts, params)
    seconds = time.perf_counter() - start
    if lengths != [i.max_tokens for i in items]:
        raise RuntimeError(f"{system}: output lengths differ from max_tokens")
    return {"seconds": seconds, "output_tokens": sum(lengths), "prompt_tokens": sum(len(p) for p in prompts),
            "prompt_lens": [len(p) for p in prompts], "output_lens": lengths}


def work_flops(config: dict, prompt_lens: list[int], output_lens: list[int]) -> float:
    """FLOPs of every processed token: 2 per weight of the layers for each token computed (prompt tokens and all
    but the last output token), the LM head for each sampled token, and attention's QK^T and PV over each
    token's causal context."""
    from benchmarks.roofline import model_linear_shapes

    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    layer_flops = 2 * sum(n * k for n, k in model_linear_shapes(config)) * layers
    head_flops = 2 * hidden * config["vocab_size"]
    total = 0.0
    for prompt, output in zip(prompt_lens, output_lens, strict=True):
        computed = prompt + output - 1
        total += computed * layer_flops + output * head_flops
        # Token at position p attends over p + 1 keys: 4 * heads * head_dim FLOPs per key per layer.
        total += 4 * heads * head_dim * layers * computed * (computed + 1) / 2
    return total


def run_worker(system: str, args: argparse.Namespace, model_dir: str, max_num_seqs: int, num_requests: int) -> dict:
    cmd = [args.vllm_python if system == "vllm" else sys.executable, "-m", "benchmarks.inproc_peer",
           "--worker", system, "--model-dir", model_dir, "--max-num-seqs", str(max_num_seqs),
           "--num-requests", str(num_requests), "--seed", str(args.seed), "--workload", args.workload,
           "--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype]
    env = os.environ.copy()
    if system == "vllm":
        from benchmarks.compare import vllm_env

        env = vllm_env(args.vllm_python, os.cpu_count() or 1)
    return run_result_process(cmd, env, 3600, f"{system} at max batch {max_num_seqs}")


def run_result_process(cmd: list[str], env: dict[str, str], timeout_s: float, label: str) -> dict:
    """Run a measuring process (one system, in its own venv) and return the JSON of its last "RESULT " line.
    It runs in the repository root, so `python -m benchmarks.X` finds the benchmarks package."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{label} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def kv_cache_dtype_choices() -> tuple[str, ...] | None:
    """serving.config's choices; None in vLLM's venv, where this file runs as the worker without conveyor."""
    try:
        from conveyor.serving.config import KV_CACHE_DTYPES  # dataclasses only: neither torch nor ray
    except ModuleNotFoundError:
        return None
    return KV_CACHE_DTYPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="conveyor,vllm")
    parser.add_argument("--max-num-seqs", default="1,64")
    parser.add_argument("--num-requests", default="8,64", help="per max batch, in the same order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", default="long-tail", help="long-tail, or fixed:IN:OUT (tokens)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="both systems (bfloat16: fast only where the CPU has native bf16)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=kv_cache_dtype_choices(),
                        help="Conveyor only (vLLM keeps its KV cache at --dtype)")
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(args.worker, args.model_dir, int(args.max_num_seqs), int(args.num_requests), args.seed,
                        args.workload, args.dtype, args.kv_cache_dtype)
        print("RESULT " + json.dumps(result), flush=True)
        return
    import torch

    from benchmarks.roofline import linear_flops, matmul_flops, model_linear_shapes
    from conveyor.serving.models.loader import resolve_model_path

    model_dir = str(resolve_model_path("smollm2"))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = getattr(torch, args.dtype)
    square = matmul_flops(dtype=dtype)
    gemm = max(square, linear_flops(model_linear_shapes(config), dtype=dtype))
    print(f"{args.dtype} GEMM rate (this run): {gemm / 1e9:.1f} GFLOP/s, the best of the model's linears at 512 rows "
          f"(oneDNN packed or MKL) and a 1024^3 torch.mm ({square / 1e9:.1f}); workload {args.workload}")
    rows = []
    for max_num_seqs, num_requests in zip(args.max_num_seqs.split(","), args.num_requests.split(","), strict=True):
        by_system = {}
        for system in args.systems.split(","):
            r = run_worker(system, args, model_dir, int(max_num_seqs), int(num_requests))
            flops = work_flops(config, r.pop("prompt_lens"), r.pop("output_lens"))
            r.update(system=system, max_num_seqs=int(max_num_seqs), num_requests=int(num_requests),
                     output_tok_per_s=r["output_tokens"] / r["seconds"], achieved_gflops=flops / r["seconds"] / 1e9,
                     gemm_gflops=gemm / 1e9, gemm_fraction=flops / r["seconds"] / gemm)
            by_system[system] = r
            rows.append(r)
            print(f"max batch {max_num_seqs:>3} {system:>14}: {r['output_tok_per_s']:7.1f} output tok/s, "
                  f"{r['achieved_gflops']:6.1f} GFLOP/s = {r['gemm_fraction']:.0%} of the GEMM rate "
                  f"({r['seconds']:.1f} s, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens)",
                  flush=True)
        if {"conveyor", "vllm"} <= set(by_system):
            ratio = by_system["conveyor"]["output_tok_per_s"] / by_system["vllm"]["output_tok_per_s"]
            print(f"max batch {max_num_seqs:>3}: Conveyor / vLLM = {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"gemm_gflops": gemm / 1e9, "square_mm_gflops": square / 1e9,
                                         "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                                         "workload": args.workload,
                                         "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
