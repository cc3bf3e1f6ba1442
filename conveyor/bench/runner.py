"""`conveyor bench` and `conveyor bench compare`: argument parsing, runs, JSON and plots (the tables: report.py)."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conveyor.bench.client import run_load, validate_base_url, warmup
from conveyor.bench.machine import cpu_model
from conveyor.bench.metrics import RequestResult, parse_goodput, parse_goodput_spec, summarize
from conveyor.bench.plots import MISSING_MATPLOTLIB, plot_curves, plot_goodput, plot_itl_timeline, plots_available
from conveyor.bench.report import goodput_table, print_summary, ratio_table, score
from conveyor.bench.workload import (
    DATASETS,
    BenchRequest,
    arrival_offsets,
    derive_seed,
    make_workload,
    shared_prefix,
    timed_offsets,
)

# Relative to the working directory: an installed package has no source tree to write into.
RESULTS_DIR = Path("bench_results")
API_KEY_ENV = ("CONVEYOR_API_KEY", "OPENAI_API_KEY")  # the first one set is --api-key's default


def default_api_key() -> str | None:
    """--api-key's default: the first of API_KEY_ENV set in the environment."""
    return next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), None)


def _usage_error(convert, text: str):  # noqa: ANN001, ANN202 - any str -> value converter raising ValueError
    """argparse shows an ArgumentTypeError's message as the usage error (exit 2, before any request is sent)
    rather than a traceback."""
    try:
        return convert(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def base_url_arg(text: str) -> str:
    return _usage_error(validate_base_url, text)


def _number_arg(kind: type, inclusive: bool) -> Callable[[str], float]:
    """An argparse type: kind(text) if finite and > 0 (or equal, with inclusive); a usage error saying why."""
    def convert(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not inclusive):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'>=' if inclusive else '>'} 0")
        return value

    return convert


positive_int = _number_arg(int, inclusive=False)
non_negative_int = _number_arg(int, inclusive=True)
positive_float = _number_arg(float, inclusive=False)
non_negative_float = _number_arg(float, inclusive=True)


def parse_rates(text: str) -> list[float]:
    """'1,2,inf' -> [1.0, 2.0, inf]: each rate > 0 (inf sends everything at once); ValueError otherwise."""
    rates = []
    for item in (x.strip() for x in text.split(",")):
        try:
            rate = float(item)
        except ValueError:
            raise ValueError(f"bad rate {item!r} in {text!r}: expected req/s, e.g. 2,3,4 or inf") from None
        if math.isnan(rate) or rate <= 0:
            raise ValueError(f"bad rate {item!r} in {text!r}: a rate must be > 0 (or inf)")
        rates.append(rate)
    return rates


def rates_arg(text: str) -> list[float]:
    return _usage_error(parse_rates, text)


def goodput_arg(text: str) -> str:
    """One --goodput entry, checked (KEY:MS) and kept as given: saved runs store the strings."""
    _usage_error(parse_goodput_spec, text)
    return text


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
    p.add_argument("--num-prompts", type=positive_int, default=40, help="measured requests per rate point")
    p.add_argument("--dataset", choices=DATASETS, default="sharegpt",
                   help="sharegpt: seeded long tail; random: fixed --input-len/--output-len; lognormal: prompts "
                        "median 163 / mean 210 tokens in [16, 1240], outputs median 48 / mean 68 in [4, 300] "
                        "(issue 38's goodput workload)")
    p.add_argument("--input-len", type=positive_int, default=200)
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--max-prompt-len", type=positive_int, default=512)
    p.add_argument("--max-output-len", type=positive_int, default=128)
    p.add_argument("--max-token-id", type=positive_int, default=49_000, help="random prompt ids < this (the vocab)")
    p.add_argument("--random-prefix-len", type=non_negative_int, default=0,
                   help="as vLLM's: this many tokens, the same for every request of every rate point, before "
                        "each prompt (the shared-prefix case: a prefix cache serves them)")
    p.add_argument("--same-prompts-every-rate", action="store_true",
                   help="every rate point sends the same prompts (by default each point draws its own from the "
                        "seed, so no point is served from an earlier one's prefix cache)")
    p.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=positive_int, default=None)
    p.add_argument("--num-warmups", type=non_negative_int, default=2,
                   help="requests sent all at once before each point, not measured (one-off costs)")
    p.add_argument("--warmup-s", type=non_negative_float, default=0.0,
                   help="before each point's measured requests, send load at the point's own rate for this many "
                        "seconds (own prompts) and leave those requests out of the statistics: the measured "
                        "requests then meet a server in steady state, not an empty one (finite rates only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", type=goodput_arg, default=None, metavar="KEY:MS",
                   help="SLOs for goodput and attainment, vLLM's keys: ttft, tpot (mean per request after the first "
                        "token), e2el; and itl (the longest gap in a request's stream), e.g. ttft:2000 tpot:100")
    p.add_argument("--timeout-s", type=positive_float, default=600.0, help="per request")
    p.add_argument("--out", default=None, help=f"JSON path, PNGs beside it (default: {RESULTS_DIR}/<mode>_<time>.json)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plot", action="store_true", help="no PNG figures (they need matplotlib)")
    p.add_argument("--api-key", default=default_api_key(),
                   help="sent to every target as 'Authorization: Bearer KEY' (default: $" + " or $".join(API_KEY_ENV)
                        + ", the first set)")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, type=base_url_arg,
                   help="root URL of any OpenAI-compatible server (without /v1), e.g. http://10.0.0.5:8000")
    p.add_argument("--request-rate", type=rates_arg, default="inf",
                   help="req/s, or a comma list to sweep; inf = all at once")
    add_workload_args(p)


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", required=True, type=targets_arg,
                   help="name=url,name=url: OpenAI-compatible servers (the first is the numerator)")
    p.add_argument("--request-rates", required=True, type=rates_arg, help="comma list of req/s")
    p.add_argument("--itl-slo-ms", type=positive_float, default=300.0, help="p99 ITL SLO for capacity")
    add_workload_args(p)


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
