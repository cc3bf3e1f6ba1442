"""Offline throughput: continuous vs static batching (same engine) vs transformers generate, one run.

    .venv/bin/python -m benchmarks.offline                 # 128 requests, SmolLM2, max batch 16
    .venv/bin/python -m benchmarks.offline --num-requests 32 --systems continuous,static
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.roofline import copy_bandwidth, decode_step_floor, linear_flops, matmul_flops, model_linear_shapes
from benchmarks.workload import WorkItem, long_tail_workload
from conveyor.serving import LLM, SamplingParams


def run_engine(llm: LLM, items: list[WorkItem]) -> dict:
    params = [SamplingParams(max_tokens=i.max_tokens, temperature=0.0, ignore_eos=True) for i in items]
    start = time.perf_counter()
    results = llm.generate([i.prompt_token_ids for i in items], params)
    elapsed = time.perf_counter() - start
    num_output = sum(len(r.token_ids) for r in results)
    assert num_output == sum(i.max_tokens for i in items), "every request must produce its max_tokens"
    return {"seconds": elapsed, "output_tokens": num_output, "requests": len(items)}


def run_transformers(model_dir: Path, items: list[WorkItem], batch_size: int) -> dict:
    """transformers generate in static batches: each batch runs until its longest member's max_tokens;
    only each request's own tokens count as output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = model.config.eos_token_id
    start = time.perf_counter()
    num_output = 0
    for b in range(0, len(items), batch_size):
        batch = items[b:b + batch_size]
        width = max(len(i.prompt_token_ids) for i in batch)
        ids = torch.tensor([[pad_id] * (width - len(i.prompt_token_ids)) + i.prompt_token_ids for i in batch])
        mask = torch.tensor([[0] * (width - len(i.prompt_token_ids)) + [1] * len(i.prompt_token_ids)
                             for i in batch])
        longest = max(i.max_tokens for i in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad_id)
        num_output += sum(i.max_tokens for i in batch)
    return {"seconds": time.perf_counter() - start, "output_tokens": num_output, "requests": len(items)}


def decode_step_times(llm: LLM, batch_sizes: list[int], prompt_len: int = 128, num_tokens: int = 24) -> dict:
    """Median time of decode-only steps at each batch size."""
    engine = llm.engine
    out = {}
    for batch_size in batch_sizes:
        for i in range(batch_size):
            prompt = [1000 + (i * 37 + j) % 40_000 for j in range(prompt_len)]
            engine.add_request(engine.make_request(prompt, SamplingParams(max_tokens=num_tokens, ignore_eos=True)))
        times = []
        while engine.has_unfinished():
            _, stats = engine.step()
            if stats.num_prefill_tokens == 0 and stats.batch_size == batch_size:
                times.append(stats.step_time_s)
        times.sort()
        out[batch_size] = times[len(times) // 2]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--systems", default="continuous,static,transformers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    items = long_tail_workload(args.num_requests, seed=args.seed)
    print(f"workload: {len(items)} requests, prompt tokens {sum(len(i.prompt_token_ids) for i in items)}, "
          f"output tokens {sum(i.max_tokens for i in items)}, max batch {args.max_num_seqs}, "
          f"torch threads {torch.get_num_threads()}")
    systems = args.systems.split(",")
    results: dict[str, dict] = {}
    llm = None
    for system in systems:
        if system in ("continuous", "static"):
            llm = LLM(args.model, scheduling=system, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens)
            results[system] = run_engine(llm, items)
        elif system == "transformers":
            from conveyor.serving.models.loader import resolve_model_path

            results[system] = run_transformers(resolve_model_path(args.model), items, args.max_num_seqs)
        else:
            raise SystemExit(f"unknown system {system!r}")
        r = results[system]
        r["output_tok_per_s"] = r["output_tokens"] / r["seconds"]
        r["req_per_s"] = r["requests"] / r["seconds"]
        print(f"{system:>13}: {r['output_tok_per_s']:7.1f} output tok/s  {r['req_per_s']:6.3f} req/s  "
              f"({r['seconds']:.1f} s)", flush=True)
    if "continuous" in results:
        base = results["continuous"]["output_tok_per_s"]
        for other in [s for s in results if s != "continuous"]:
            ratio = base / results[other]["output_tok_per_s"]
            results[f"continuous_vs_{other}"] = ratio
            print(f"continuous / {other}: {ratio:.2f}x")
    if llm is not None:
        results["roofline"] = roofline_report(llm)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def roofline_report(llm: LLM) -> dict:
    hf = llm.engine.hf_config.to_dict()
    flops, bandwidth = max(matmul_flops(), linear_flops(model_linear_shapes(hf))), copy_bandwidth()
    num_params = llm.engine.num_params
    steps = decode_step_times(llm, [1, 16])
    print(f"roofline: fp32 matmul {flops / 1e9:.1f} GFLOP/s, copy {bandwidth / 1e9:.1f} GB/s, "
          f"{num_params / 1e6:.1f}M params")
    report = {"matmul_gflops": flops / 1e9, "copy_gb_s": bandwidth / 1e9, "decode": {}}
    block_bytes, block_params = gguf_block_weights(llm)
    for batch_size, measured in steps.items():
        floor = decode_step_floor(num_params, 4, batch_size, flops, bandwidth)
        report["decode"][batch_size] = {"measured_ms": measured * 1e3, "floor_ms": floor * 1e3}
        print(f"  decode step at batch {batch_size:>3}: {measured * 1e3:6.1f} ms measured, "
              f"{floor * 1e3:6.1f} ms floor of fp32 weights ({measured / floor:.2f}x the floor), "
              f"{batch_size / measured:6.1f} tok/s")
        if block_params and batch_size <= llm.engine.gguf_max_rows:
            # What the step reads when its linears use the GGUF blocks: their bytes plus the other fp32 weights.
            read = block_bytes + 4 * (num_params - block_params)
            byte_floor = max(read / bandwidth, 2 * num_params * batch_size / flops)
            report["decode"][batch_size]["gguf_floor_ms"] = byte_floor * 1e3
            print(f"    reading the GGUF blocks ({read / 1e6:.0f} MB, not {4 * num_params / 1e6:.0f}): floor "
                  f"{byte_floor * 1e3:.1f} ms ({measured / byte_floor:.2f}x it)")
    return report


def gguf_block_weights(llm: LLM) -> tuple[int, int]:
    """(bytes of the GGUF blocks small steps read, parameters they stand for)."""
    from conveyor.serving.models.gguf_weights import GGUFLinear

    layers = [m for m in llm.engine.model.modules() if isinstance(m, GGUFLinear)]
    return (sum(m.weight.nbytes for m in layers), sum(m.out_features * m.weight.in_features for m in layers))


if __name__ == "__main__":
    main()
