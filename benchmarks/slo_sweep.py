"""Tail-latency mode vs fixed token budgets across request rates (in process: AsyncEngine, no HTTP/Ray).

Each (rate, config) point replays the same seeded long-tail workload (Poisson arrivals, prompts 16-1024,
outputs 8-128, ignore-EOS) on a fresh engine; configs alternate within a rate so they share the machine's
load. The claim checked: with --itl-slo-ms X, p99 ITL <= X at every rate, and its output throughput is
within 10% of the best fixed budget that also meets X; a large fixed budget breaks X.

    .venv/bin/python -m benchmarks.slo_sweep                                  # ~8 minutes on 2 cores
    .venv/bin/python -m benchmarks.slo_sweep --rates 0.5,1 --budgets 64,1024 --num-prompts 20
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from benchmarks.inproc import make_engine, run_inproc, stream_one
from conveyor.bench.metrics import summarize
from conveyor.bench.plots import plot_curves
from conveyor.bench.workload import (
    arrival_offsets,
    build_requests,
    sharegpt_like_lengths,
)

RESULTS = Path(os.environ.get("CONVEYOR_ARTIFACTS") or Path(__file__).resolve().parent / "out")  # git-ignored


async def run_point(name: str, budget: int, slo: float | None, rate: float, args: argparse.Namespace) -> dict:
    lengths = sharegpt_like_lengths(args.num_prompts, args.seed, max_prompt=args.max_prompt,
                                    max_output=args.max_output)
    reqs = build_requests(lengths, args.seed)
    offsets = arrival_offsets(len(reqs), rate, 1.0, args.seed)
    engine = make_engine(args.model, budget, max_num_seqs=32, itl_slo_ms=slo)
    try:
        # warm-up, and in tail-latency mode the first step timings for the cost model to learn from
        await asyncio.gather(*(stream_one(engine, r, 0.0) for r in build_requests([(128, 8)] * 4, 999)))
        results, duration = await run_inproc(engine, reqs, offsets)
    finally:
        engine.shutdown()
    return {"config": name, "budget": budget, "itl_slo_ms": slo,
            **summarize(results, duration, rate, {"itl": args.slo_ms})}


def verdict(rows: dict[str, list[dict]], slo_name: str, slo_ms: float) -> list[str]:
    """Per rate: does the SLO config meet X, which fixed budgets meet X, and the throughput ratio."""
    lines = []
    for j, r in enumerate(rows[slo_name]):
        fixed_ok = {n: rs[j] for n, rs in rows.items() if n != slo_name and rs[j]["itl_ms"]["p99"] <= slo_ms}
        best = max(fixed_ok.values(), key=lambda x: x["output_throughput"], default=None)
        ratio = r["output_throughput"] / best["output_throughput"] if best else float("nan")
        lines.append(f"rate {r['offered_rate']:g}: {slo_name} p99 ITL {r['itl_ms']['p99']:.0f} ms "
                     f"({'meets' if r['itl_ms']['p99'] <= slo_ms else 'MISSES'} {slo_ms:g}); best fixed that "
                     f"meets it: {best['config'] if best else 'none'}; throughput ratio {ratio:.2f}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rates", default="0.5,1")
    p.add_argument("--budgets", default="32,64,1024", help="fixed max_num_batched_tokens to compare")
    p.add_argument("--slo-ms", type=float, default=250.0)
    p.add_argument("--slo-cap", type=int, default=4096, help="max_num_batched_tokens in tail-latency mode")
    p.add_argument("--num-prompts", type=int, default=30)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "slo_sweep.json"))
    args = p.parse_args()
    configs = {f"itl_slo_ms={args.slo_ms:g}": (args.slo_cap, args.slo_ms)}
    configs |= {f"fixed {b}": (int(b), None) for b in args.budgets.split(",")}
    rows: dict[str, list[dict]] = {n: [] for n in configs}
    for i, rate in enumerate(float(x) for x in args.rates.split(",")):
        names = list(configs) if i % 2 == 0 else list(configs)[::-1]
        for name in names:
            row = asyncio.run(run_point(name, *configs[name], rate, args))
            rows[name].append(row)
            print(f"rate {rate:<4g} {name:>18}: tok/s {row['output_throughput']:.1f} req/s "
                  f"{row['request_throughput']:.2f} ITL p50/p99 {row['itl_ms']['p50']:.0f}/"
                  f"{row['itl_ms']['p99']:.0f} ms TTFT p50/p99 {row['ttft_ms']['p50']:.0f}/"
                  f"{row['ttft_ms']['p99']:.0f} ms done {row['completed']}/{row['num_requests']}", flush=True)
    for n in rows:
        rows[n].sort(key=lambda r: r["offered_rate"])
    lines = verdict(rows, next(iter(configs)), args.slo_ms)
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "verdict": lines}, indent=1))
    plot_curves(rows, out.with_suffix(".png"), args.slo_ms)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
