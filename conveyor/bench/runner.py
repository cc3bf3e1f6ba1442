"""`conveyor bench` and `conveyor bench compare`: argument parsing, runs, tables, JSON and plots."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from pathlib import Path

from conveyor.bench.client import run_load, validate_base_url, warmup
from conveyor.bench.metrics import parse_goodput, summarize
from conveyor.bench.plots import MISSING_MATPLOTLIB, plot_curves, plot_itl_timeline, plots_available
from conveyor.bench.workload import arrival_offsets, make_workload

# Relative to the working directory: an installed package has no source tree to write into.
RESULTS_DIR = Path("bench_results")
API_KEY_ENV = ("CONVEYOR_API_KEY", "OPENAI_API_KEY")  # the first one set is --api-key's default


def default_api_key() -> str | None:
    """--api-key's default: the first of API_KEY_ENV set in the environment."""
    return next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), None)


def base_url_arg(text: str) -> str:
    """argparse type for a server URL: a ValueError's message becomes the usage error."""
    try:
        return validate_base_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def targets_arg(text: str) -> dict[str, str]:
    """argparse type for name=url,name=url."""
    targets = {}
    for item in text.split(","):
        name, sep, url = item.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"bad target {item!r}; expected name=url")
        targets[name] = base_url_arg(url)
    return targets


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="the model name each request asks the server for")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--dataset", choices=["sharegpt", "random"], default="sharegpt",
                   help="sharegpt: seeded long tail; random: fixed --input-len/--output-len")
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--max-token-id", type=int, default=49_000, help="random prompt ids < this (the vocab)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS", help="e.g. ttft:2000 itl:300")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    p.add_argument("--out", default=None, help=f"JSON path, PNGs beside it (default: {RESULTS_DIR}/<mode>_<time>.json)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plot", action="store_true", help="no PNG figures (they need matplotlib)")
    p.add_argument("--api-key", default=default_api_key(),
                   help="sent to every target as 'Authorization: Bearer KEY' (default: $" + " or $".join(API_KEY_ENV)
                        + ", the first set)")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, type=base_url_arg,
                   help="root URL of any OpenAI-compatible server (without /v1), e.g. http://10.0.0.5:8000")
    p.add_argument("--request-rate", default="inf", help="req/s, or a comma list to sweep; inf = all at once")
    add_workload_args(p)


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", required=True, type=targets_arg,
                   help="name=url,name=url: OpenAI-compatible servers (the first is the numerator)")
    p.add_argument("--request-rates", required=True, help="comma list of req/s")
    p.add_argument("--itl-slo-ms", type=float, default=300.0, help="p99 ITL SLO for capacity")
    add_workload_args(p)


def parse_rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def run_point(url: str, args: argparse.Namespace, rate: float, desc: str) -> tuple[dict, list]:
    """One (target, rate) measurement: warm-up, then the seeded workload. The seed depends on the rate but not
    on the target, so every target sees the same requests at the same offsets, and no target's prefix cache
    holds a rate's prompts from an earlier rate (which would make later points cheaper than their load)."""
    seed = args.seed + (round(rate * 1000) if math.isfinite(rate) else 0)
    reqs = make_workload(args.dataset, args.num_prompts, seed, args.input_len, args.output_len,
                         args.max_prompt_len, args.max_output_len, args.max_token_id)
    offsets = arrival_offsets(len(reqs), rate, args.burstiness, seed)
    warm = make_workload("random", args.num_warmups, args.seed + 99, 32, 8, vocab_high=args.max_token_id)
    api_key = getattr(args, "api_key", None)
    asyncio.run(warmup(url, args.model, warm, api_key=api_key))
    results, duration = asyncio.run(run_load(url, args.model, reqs, offsets, args.max_concurrency,
                                             args.timeout_s, not args.no_progress, desc, api_key=api_key))
    summary = summarize(results, duration, rate, parse_goodput(args.goodput))
    return summary, results


def print_summary(name: str, s: dict) -> None:
    print(f"{name:>12} rate={s['offered_rate']:<5g} done={s['completed']}/{s['num_requests']} "
          f"req/s={s['request_throughput']:.2f} tok/s={s['output_throughput']:.1f} "
          f"TTFT p50/p99={s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} "
          f"ITL p50/p99={s['itl_ms']['p50']:.0f}/{s['itl_ms']['p99']:.0f} ms"
          + (f" goodput={s['goodput']:.2f}" if "goodput" in s else ""), flush=True)


def _out_path(args: argparse.Namespace, stem: str) -> Path:
    path = Path(args.out) if args.out else RESULTS_DIR / f"{stem}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def args_record(args: argparse.Namespace) -> dict:
    """The arguments as saved with the results: no callback, and no API key (only whether one was sent)."""
    record = {k: v for k, v in vars(args).items() if k != "func"}
    if record.get("api_key"):
        record["api_key"] = "<redacted>"
    return record


def want_plots(args: argparse.Namespace) -> bool:
    if getattr(args, "no_plot", False):
        return False
    if not plots_available():
        print(MISSING_MATPLOTLIB, flush=True)
        return False
    return True


def cmd_bench(args: argparse.Namespace) -> int:
    rows, timelines = [], {}
    for rate in parse_rates(args.request_rate):
        summary, results = run_point(args.base_url, args, rate, f"rate {rate:g}")
        print_summary("target", summary)
        rows.append({**summary, "requests": [r.to_dict() for r in results]})
        timelines[f"rate {rate:g}"] = _itl_series(results)
    path = _out_path(args, "bench")
    path.write_text(json.dumps({"args": args_record(args), "points": rows}, indent=1))
    if want_plots(args):
        plot_curves({"target": rows}, path.with_suffix(".png"))
        plot_itl_timeline(timelines, path.with_name(path.stem + "_itl.png"), "ITL over time")
    print(f"wrote {path}")
    return 0


def _itl_series(results: list) -> tuple[list[float], list[float]]:
    ts, itl = [], []
    for r in results:
        ts += r.chunk_times[1:]
        itl += [g * 1000 for g in r.itls]
    return ts, itl


def _highest_passing_run(rows: list[dict], passes) -> float:  # noqa: ANN001 - a predicate on one row
    """Highest swept rate such that it and every lower swept rate pass: a system that fails at 1.5 req/s but
    passes at 2 (a short run that had not yet shown its queue) gets 1, not 2. 0 if the lowest fails."""
    best = 0.0
    for r in sorted(rows, key=lambda r: r["offered_rate"]):
        if not passes(r):
            break
        best = r["offered_rate"]
    return best


def capacity(rows: list[dict], slo_ms: float, ttft_slo_ms: float | None = None, keep_up: float = 0.8) -> float:
    """Capacity at a p99 ITL SLO: every request completed, p99 ITL within the SLO and the system keeping up:
    TTFT p99 within ttft_slo_ms when one is given (a queue that grows shows up as TTFT), else an achieved
    request rate within keep_up of the offered one (biased low for short runs: the drain counts)."""
    def passes(r: dict) -> bool:
        if ttft_slo_ms is not None:
            keeps_up = r["ttft_ms"]["p99"] <= ttft_slo_ms
        else:
            keeps_up = r["request_throughput"] >= keep_up * r["offered_rate"]
        return (r["failed"] == 0 and not math.isnan(r["itl_ms"]["p99"]) and r["itl_ms"]["p99"] <= slo_ms
                and keeps_up)

    return _highest_passing_run(rows, passes)


def attainment_capacity(rows: list[dict], attainment: float = 0.9) -> float | None:
    """Capacity as the share of requests that met every goodput SLO (at least `attainment`, the DistServe
    definition), over the same monotone run of rates; None without --goodput."""
    if not rows or "good_requests" not in rows[0]:
        return None
    return _highest_passing_run(rows, lambda r: r["good_requests"] >= attainment * r["num_requests"])


def compare(targets: dict[str, str], args: argparse.Namespace) -> dict:
    """Every rate, every target, alternating the order per rate so neither side always runs first."""
    per_target: dict[str, list[dict]] = {n: [] for n in targets}
    names = list(targets)
    for i, rate in enumerate(parse_rates(args.request_rates)):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            summary, _ = run_point(targets[name], args, rate, f"{name} @ {rate:g}")
            print_summary(name, summary)
            per_target[name].append(summary)
    for rows in per_target.values():
        rows.sort(key=lambda r: r["offered_rate"])
    return score(per_target, args.itl_slo_ms, parse_goodput(args.goodput))


def score(per_target: dict[str, list[dict]], itl_slo_ms: float, goodput_slo: dict[str, float]) -> dict:
    """Capacities of measured rows (also to re-score a saved run under a changed capacity definition)."""
    caps = {n: capacity(rows, itl_slo_ms, goodput_slo.get("ttft")) for n, rows in per_target.items()}
    slo_caps = {n: attainment_capacity(rows) for n, rows in per_target.items()}
    return {"per_target": per_target, "capacity": caps, "itl_slo_ms": itl_slo_ms,
            "slo_attainment_capacity": slo_caps, "goodput_slo": goodput_slo}


def ratio_table(result: dict) -> str:
    """Markdown: per rate, each target's tok/s and p99 ITL, and the first target's ratio over each."""
    per_target, names = result["per_target"], list(result["per_target"])
    base = names[0]
    head = "| rate | " + " | ".join(f"{n} tok/s, p50/p99 ITL ms" for n in names) + " | " + " | ".join(
        f"{base}/{n} tok/s" for n in names[1:]) + " |"
    lines = [head, "|" + "---|" * (1 + len(names) + len(names) - 1)]
    for j, row in enumerate(per_target[base]):
        cells = [f"{row['offered_rate']:g}"]
        for n in names:
            r = per_target[n][j]
            cells.append(f"{r['output_throughput']:.1f}, {r['itl_ms']['p50']:.0f}/{r['itl_ms']['p99']:.0f}")
        for n in names[1:]:
            other = per_target[n][j]["output_throughput"]
            cells.append(f"{row['output_throughput'] / other:.2f}x" if other else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    caps = result["capacity"]
    lines.append("")
    ttft = (result.get("goodput_slo") or {}).get("ttft")
    lines.append(f"Capacity at p99 ITL <= {result['itl_slo_ms']:g} ms"
                 + (f" and p99 TTFT <= {ttft:g} ms" if ttft else "") + " (req/s): "
                 + ", ".join(f"{n} {c:g}" for n, c in caps.items()))
    lines += _capacity_ratios(caps, base, names)
    slo_caps = result.get("slo_attainment_capacity") or {}
    if any(c is not None for c in slo_caps.values()):
        lines.append(f"Capacity at >= 90% of requests meeting {result['goodput_slo']} (req/s): "
                     + ", ".join(f"{n} {c:g}" for n, c in slo_caps.items()))
        lines += _capacity_ratios(slo_caps, base, names)
    return "\n".join(lines)


def _capacity_ratios(caps: dict[str, float], base: str, names: list[str]) -> list[str]:
    lines = []
    for n in names[1:]:
        ratio = f"{caps[base] / caps[n]:.2f}x" if caps[n] else ("inf (other 0)" if caps[base] else "n/a")
        lines.append(f"capacity {base}/{n}: {ratio}")
    return lines


def write_compare(result: dict, args: argparse.Namespace, stem: str = "compare") -> Path:
    path = _out_path(args, stem)
    path.write_text(json.dumps({"args": args_record(args), **result}, indent=1))
    if want_plots(args):
        plot_curves(result["per_target"], path.with_suffix(".png"), result["itl_slo_ms"])
    return path


def cmd_compare(args: argparse.Namespace) -> int:
    result = compare(args.targets, args)
    print(ratio_table(result))
    print(f"wrote {write_compare(result, args)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor bench",
                                     description="serving benchmark over HTTP against any OpenAI-compatible server "
                                     "(streamed /v1/completions with token-id prompts; `conveyor bench compare "
                                     "--help` for the side-by-side mode)")
    add_bench_args(parser)
    parser.set_defaults(func=cmd_bench)
    return parser


def build_compare_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor bench compare",
                                     description="one workload against several OpenAI-compatible servers, "
                                     "alternating")
    add_compare_args(parser)
    parser.set_defaults(func=cmd_compare)
    return parser


def main(argv: list[str]) -> int:
    if argv and argv[0] == "compare":
        args = build_compare_parser().parse_args(argv[1:])
    else:
        args = build_parser().parse_args(argv)
    return args.func(args)
