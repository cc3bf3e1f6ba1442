"""`conveyor bench` and `conveyor bench compare`: runs, JSON and plots (arguments: cli_args.py; tables: report.py)."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from conveyor.bench.cli_args import RESULTS_DIR, add_bench_args, add_compare_args
from conveyor.bench.client import run_load, warmup
from conveyor.bench.machine import cpu_model
from conveyor.bench.metrics import RequestResult, parse_goodput, summarize
from conveyor.bench.plots import MISSING_MATPLOTLIB, plot_curves, plot_goodput, plot_itl_timeline, plots_available
from conveyor.bench.report import goodput_table, print_summary, ratio_table, score
from conveyor.bench.workload import (
    BenchRequest,
    arrival_offsets,
    derive_seed,
    make_workload,
    shared_prefix,
    timed_offsets,
)


@dataclass(frozen=True)
class PointPlan:
    """One rate point's requests in send order: the warm-up window's first, then the measured ones."""
    requests: list[BenchRequest]
    offsets: list[float]  # send times, s from the point's start
    num_warmup: int  # the first num_warmup requests are warm-up: never measured
    window_start_s: float  # the measured window opens here (the end of the warm-up)


def plan_point(args: argparse.Namespace, rate: float, index: int) -> PointPlan:
    """The seeded requests of the index-th rate point. Every point draws its own prompts (unless
    --same-prompts-every-rate), from the seed and the point's index but not the target, so every target sees the
    same requests at the same offsets and no target's prefix cache holds a point's prompts from an earlier point.
    With --warmup-s, the point first carries that many seconds of load at its rate, with prompts of its own."""
    point = 0 if args.same_prompts_every_rate else index
    seed = derive_seed(args.seed, point, "measure")
    prefix = shared_prefix(args.random_prefix_len, args.seed, args.max_token_id) if args.random_prefix_len else None

    def draw(num: int, draw_seed: int) -> list[BenchRequest]:
        return make_workload(args.dataset, num, draw_seed, args.input_len, args.output_len, args.max_prompt_len,
                             args.max_output_len, args.max_token_id, prefix)

    start = args.warmup_s if math.isfinite(rate) else 0.0  # all-at-once has no rate to warm up at
    warm_offsets = timed_offsets(start, rate, args.burstiness, derive_seed(args.seed, point, "warmup arrivals"))
    warm = draw(len(warm_offsets), derive_seed(args.seed, point, "warmup"))
    measured = draw(args.num_prompts, seed)
    offsets = [start + t for t in arrival_offsets(len(measured), rate, args.burstiness, seed)]
    return PointPlan(warm + measured, warm_offsets + offsets, len(warm), start)


def measured_window(plan: PointPlan, results: list[RequestResult]) -> tuple[list[RequestResult], float]:
    """The measured requests and the window's length: from its opening to the last measured request's end (the
    warm-up's stragglers do not stretch it)."""
    measured = results[plan.num_warmup:]
    end = max((r.send_time + r.e2e for r in measured), default=plan.window_start_s)
    return measured, end - plan.window_start_s


def run_point(url: str, args: argparse.Namespace, rate: float, desc: str, index: int = 0
              ) -> tuple[dict, list[RequestResult]]:
    """One (target, rate) measurement: --num-warmups requests at once, then the planned point (warm-up window
    and measured requests in one open-loop stream)."""
    plan = plan_point(args, rate, index)
    burst = make_workload("random", args.num_warmups, derive_seed(args.seed, index, "burst warmup"), 32, 8,
                          vocab_high=args.max_token_id)
    api_key = getattr(args, "api_key", None)
    asyncio.run(warmup(url, args.model, burst, api_key=api_key))
    results, _ = asyncio.run(run_load(url, args.model, plan.requests, plan.offsets, args.max_concurrency,
                                      args.timeout_s, not args.no_progress, desc, api_key=api_key))
    measured, duration = measured_window(plan, results)
    summary = summarize(measured, duration, rate, parse_goodput(args.goodput))
    summary["num_warmup_requests"] = plan.num_warmup
    return summary, measured


def plot_title(servers: list[str], model: str) -> str:
    """Server(s), model, date and machine: a figure read without its JSON still says what it measured."""
    return f"{', '.join(servers)} | {model} | {time.strftime('%Y-%m-%d %H:%M')} | {cpu_model()}"


def _write_json(args: argparse.Namespace, stem: str, record: dict) -> Path:
    """--out (default: RESULTS_DIR/<stem>_<time>.json) holding the arguments, the machine and `record`."""
    path = Path(args.out) if args.out else RESULTS_DIR / f"{stem}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": args_record(args), "machine": cpu_model(), **record}, indent=1))
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
    for i, rate in enumerate(args.request_rate):
        summary, results = run_point(args.base_url, args, rate, f"rate {rate:g}", i)
        print_summary("target", summary)
        rows.append({**summary, "requests": [r.to_dict() for r in results]})
        timelines[f"rate {rate:g}"] = _itl_series(results)
    if args.goodput:
        print(goodput_table({args.base_url: rows}))
    path = _write_json(args, "bench", {"points": rows})
    if want_plots(args):
        plot_curves({"target": rows}, path.with_suffix(".png"))
        plot_itl_timeline(timelines, path.with_name(path.stem + "_itl.png"), "ITL over time")
        if args.goodput:
            plot_goodput({args.base_url: rows}, path.with_name(path.stem + "_goodput.png"),
                         plot_title([args.base_url], args.model), parse_goodput(args.goodput))
    print(f"wrote {path}")
    return 0


def _itl_series(results: list) -> tuple[list[float], list[float]]:
    ts, itl = [], []
    for r in results:
        ts += r.chunk_times[1:]
        itl += [g * 1000 for g in r.itls]
    return ts, itl


def compare(targets: dict[str, str], args: argparse.Namespace) -> dict:
    """Every rate, every target, alternating the order per rate so neither side always runs first."""
    per_target: dict[str, list[dict]] = {n: [] for n in targets}
    names = list(targets)
    for i, rate in enumerate(args.request_rates):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            summary, _ = run_point(targets[name], args, rate, f"{name} @ {rate:g}", i)
            print_summary(name, summary)
            per_target[name].append(summary)
    for rows in per_target.values():
        rows.sort(key=lambda r: r["offered_rate"])
    return score(per_target, args.itl_slo_ms, parse_goodput(args.goodput))


def write_compare(result: dict, args: argparse.Namespace, stem: str = "compare") -> Path:
    path = _write_json(args, stem, result)
    if want_plots(args):
        plot_curves(result["per_target"], path.with_suffix(".png"), result["itl_slo_ms"])
        if result.get("goodput_slo"):
            plot_goodput(result["per_target"], path.with_name(path.stem + "_goodput.png"),
                         plot_title(list(result["per_target"]), args.model), result["goodput_slo"])
    return path


def cmd_compare(args: argparse.Namespace) -> int:
    result = compare(args.targets, args)
    print(ratio_table(result))
    if result["goodput_slo"]:
        print(goodput_table(result["per_target"]))
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


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """What no single argument's type can check: a usage error here, before any request is sent."""
    try:
        parse_goodput(args.goodput)
    except ValueError as exc:
        parser.error(str(exc))
    if args.max_token_id < 8:
        parser.error("--max-token-id must leave room above the special tokens (>= 8)")
    return args


def main(argv: list[str]) -> int:
    parser = build_compare_parser() if argv and argv[0] == "compare" else build_parser()
    args = check_args(parser, parser.parse_args(argv[1:] if argv and argv[0] == "compare" else argv))
    return args.func(args)
