"""The prefill-spike experiment: steady decode streams while long prompts arrive periodically.

Drives the engine in process (AsyncEngine, no HTTP/Ray), so the ITL measured is the scheduler's own.
Variants: chunked prefill at fixed budgets (256; 32 and 16, sized to this CPU's step cost); unchunked
(a 4096-token budget: each long prompt runs in one step); and tail-latency mode (--itl-slo-ms, budget from the
step-cost model). Besides the pooled ITL distribution it reports the median of the gaps measured while no long
prompt was being prefilled (the streams' undisturbed pace) and the duty cycle of long-prompt prefill, so a
ratio cannot look good merely because prefill steps became the median.

    .venv/bin/python -m benchmarks.prefill_spike                  # ~5 minutes on 2 quiet CPU cores
    .venv/bin/python -m benchmarks.prefill_spike --long-len 3072 --duration-s 40
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from benchmarks.inproc import make_engine, stream_one
from conveyor.bench.metrics import RequestResult, distribution
from conveyor.bench.plots import plot_itl_timeline
from conveyor.bench.workload import build_requests

RESULTS = Path(os.environ.get("CONVEYOR_ARTIFACTS") or Path(__file__).resolve().parent / "out")  # git-ignored


async def decode_stream(engine, idx: int, deadline: float, t0: float, out_len: int,  # noqa: ANN001
                        seed: int) -> list[RequestResult]:
    """Keep one stream busy until the deadline: a new short-prompt request as soon as the last ends."""
    results, k = [], 0
    while time.perf_counter() < deadline:
        req = build_requests([(32, out_len)], seed=seed * 1000 + idx * 100 + k)[0]
        results.append(await stream_one(engine, req, t0))
        k += 1
    return results


async def long_prompts(engine, args: argparse.Namespace, t0: float) -> list[RequestResult]:  # noqa: ANN001
    out = []
    for i in range(args.num_long):
        at = args.first_long_s + i * args.period_s
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        req = build_requests([(args.long_len, 4)], seed=args.seed + 7000 + i)[0]
        out.append(await stream_one(engine, req, t0))
    return out


async def run_variant(budget: int, slo: float | None, args: argparse.Namespace) -> dict:
    engine = make_engine(args.model, budget, max_num_seqs=32, itl_slo_ms=slo,
                         min_prefill_tokens=args.min_prefill_tokens)
    try:
        warm = build_requests([(64, 8)] * 2, seed=999)
        await asyncio.gather(*(stream_one(engine, r, time.perf_counter()) for r in warm))
        t0 = time.perf_counter()
        deadline = t0 + args.duration_s
        streams = [decode_stream(engine, i, deadline, t0, args.stream_len, args.seed)
                   for i in range(args.num_streams)]
        gathered = await asyncio.gather(long_prompts(engine, args, t0), *streams)
    finally:
        engine.shutdown()
    longs, decodes = gathered[0], [r for rs in gathered[1:] for r in rs]
    itls = [g for r in decodes for g in r.itls]
    ts = [t for r in decodes for t in r.chunk_times[1:]]
    # A gap belongs to a spike window if it ended while a long prompt was waiting for its first token.
    windows = [(r.send_time, r.send_time + r.ttft) for r in longs if r.ok]
    undisturbed = [g for g, t in zip(itls, ts, strict=True) if not any(a <= t <= b + 0.05 for a, b in windows)]
    span = max(ts, default=0.0) - min(ts, default=0.0)
    return {"budget": budget, "itl_slo_ms": slo, "itl_ms": distribution(itls),
            "undisturbed_itl_ms": distribution(undisturbed),
            "prefill_duty_cycle": sum(b - a for a, b in windows) / span if span else float("nan"),
            "long_ttft_ms": [r.ttft * 1000 for r in longs], "long_sent_s": [r.send_time for r in longs],
            "decode_tokens": sum(r.output_tokens for r in decodes),
            "timeline": {"t": ts, "itl_ms": [g * 1000 for g in itls]}}


def pool(rounds: list[dict]) -> dict:
    """One variant's rounds as one sample; timelines laid end to end (round k shifted by k * 1.05 span)."""
    itls, ts, shift = [], [], 0.0
    for r in rounds:
        itls += r["timeline"]["itl_ms"]
        ts += [t + shift for t in r["timeline"]["t"]]
        shift += 1.05 * max(r["timeline"]["t"], default=0.0)
    undisturbed_p50 = sorted(r["undisturbed_itl_ms"]["p50"] for r in rounds)[len(rounds) // 2]
    return {"budget": rounds[0]["budget"], "itl_slo_ms": rounds[0]["itl_slo_ms"],
            "itl_ms": distribution([x / 1000 for x in itls]),
            "undisturbed_itl_p50_ms_median_of_rounds": undisturbed_p50,
            "prefill_duty_cycle": [round(r["prefill_duty_cycle"], 3) for r in rounds],
            "long_ttft_ms": [x for r in rounds for x in r["long_ttft_ms"]],
            "decode_tokens": sum(r["decode_tokens"] for r in rounds),
            "load_avg_1m": [r["load_avg_1m_before"] for r in rounds], "rounds": rounds,
            "timeline": {"t": ts, "itl_ms": itls}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-streams", type=int, default=6)
    p.add_argument("--stream-len", type=int, default=96)
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--num-long", type=int, default=2, help="per round")
    p.add_argument("--first-long-s", type=float, default=3.0)
    p.add_argument("--period-s", type=float, default=14.0)
    p.add_argument("--duration-s", type=float, default=30.0, help="per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chunked-budgets", default="256,32,16", help="comma list of fixed chunked budgets")
    p.add_argument("--unchunked-budget", type=int, default=4096)
    p.add_argument("--itl-slo-ms", type=float, default=120.0, help="0 to skip the tail-latency variant")
    p.add_argument("--min-prefill-tokens", type=int, default=8,
                   help="tail-latency mode's per-step prefill floor (SchedulerConfig.min_prefill_tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "prefill_spike.json"))
    args = p.parse_args()
    variants = {f"chunked (budget {b})": (int(b), None) for b in args.chunked_budgets.split(",")}
    variants[f"unchunked (budget {args.unchunked_budget})"] = (args.unchunked_budget, None)
    if args.itl_slo_ms > 0:
        variants[f"itl_slo_ms={args.itl_slo_ms:g} (cap {args.unchunked_budget})"] = (
            args.unchunked_budget, args.itl_slo_ms)
    # The machine is shared: alternate the variants over several rounds (ABC, CBA, ...) so each sees
    # the same background load, then pool each variant's rounds.
    rounds: dict[str, list[dict]] = {n: [] for n in variants}
    for i in range(args.rounds):
        for name in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
            load = os.getloadavg()[0]
            r = asyncio.run(run_variant(*variants[name], args)) | {"load_avg_1m_before": load}
            rounds[name].append(r)
            d = r["itl_ms"]
            print(f"round {i} {name:>34}: ITL p50 {d['p50']:.0f} p99 {d['p99']:.0f} ms (load {load:.1f})",
                  flush=True)
    results = {n: pool(rs) for n, rs in rounds.items()}
    for name, r in results.items():
        d, base = r["itl_ms"], r["undisturbed_itl_p50_ms_median_of_rounds"]
        print(f"{name:>36}: ITL p50 {d['p50']:.0f} p90 {d['p90']:.0f} p99 {d['p99']:.0f} max {d['max']:.0f} ms;"
              f" p99/p50 {d['p99'] / d['p50']:.1f}; undisturbed p50 {base:.0f} (p99/that {d['p99'] / base:.1f});"
              f" prefill duty {r['prefill_duty_cycle']}; long TTFT {[round(x) for x in r['long_ttft_ms']]} ms;"
              f" decode tokens {r['decode_tokens']}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "variants": results}, indent=1))
    marks = []  # long-prompt send times, on the first variant's pooled clock
    first = next(iter(results.values()))
    shift = 0.0
    for r in first["rounds"]:
        marks += [t + shift for t in r["long_sent_s"]]
        shift += 1.05 * max(r["timeline"]["t"], default=0.0)
    plot_itl_timeline({n: (r["timeline"]["t"], r["timeline"]["itl_ms"]) for n, r in results.items()},
                      out.with_suffix(".png"), f"decode-stream ITL, {args.num_streams} streams + "
                      f"{args.long_len}-token prompts (dotted: sent, 1st variant), rounds end to end", marks)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
