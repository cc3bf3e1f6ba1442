"""`conveyor bench` and `conveyor bench compare`: argument parsing, runs, tables, JSON and plots."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from conveyor.bench.client import run_load, validate_base_url, warmup
from conveyor.bench.machine import cpu_model
from conveyor.bench.metrics import RequestResult, parse_goodput, parse_goodput_spec, summarize
from conveyor.bench.plots import (
    MISSING_MATPLOTLIB,
    plot_curves,
    plot_goodput,
    plot_itl_timeline,
    plots_available,
)
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


def base_url_arg(text: str) -> str:
    """argparse type for a server URL: a ValueError's message becomes the usage error."""
    try:
        return validate_base_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number(text: str, kind: type, low: float, inclusive: bool) -> float:
    """kind(text) if finite and above low (or equal, with inclusive); ValueError saying why otherwise."""
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
    if not math.isfinite(value) or value < low or (value == low and not inclusive):
        raise ValueError(f"{text!r} must be {'>=' if inclusive else '>'} {low:g}")
    return value


def _usage_error(convert, text: str):  # noqa: ANN001, ANN202 - any str -> value converter raising ValueError
    """argparse shows an ArgumentTypeError's message as the usage error (exit 2, before any request is sent)
    rather than a traceback."""
    try:
        return convert(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    return _usage_error(lambda t: _number(t, int, 0, inclusive=False), text)


def non_negative_int(text: str) -> int:
    return _usage_error(lambda t: _number(t, int, 0, inclusive=True), text)


def positive_float(text: str) -> float:
    return _usage_error(lambda t: _number(t, float, 0.0, inclusive=False), text)


def non_negative_float(text: str) -> float:
    return _usage_error(lambda t: _number(t, float, 0.0, inclusive=True), text)


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


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def print_summary(name: str, s: dict) -> None:
    line = (f"{name:>12} rate={s['offered_rate']:<5g} done={s['completed']}/{s['num_requests']} "
            f"refused={s.get('refused', 0)} req/s={s['request_throughput']:.2f} tok/s={s['output_throughput']:.1f} "
            f"TTFT p50/p99={_ms(s['ttft_ms']['p50'])}/{_ms(s['ttft_ms']['p99'])} "
            f"TPOT p50/p99={_ms(s['tpot_ms']['p50'])}/{_ms(s['tpot_ms']['p99'])} "
            f"ITL p50/p99={_ms(s['itl_ms']['p50'])}/{_ms(s['itl_ms']['p99'])} ms")
    if "goodput" in s:
        line += (f" attainment={100 * s['attainment']:.0f}% (admitted {100 * s['attainment_admitted']:.0f}%)"
                 f" goodput={s['goodput']:.2f} req/s")
    print(line, flush=True)


def goodput_table(per_target: dict[str, list[dict]]) -> str:
    """Markdown, one row per (rate, target): SLO attainment over every request sent (a refused one misses) and
    over the admitted ones, goodput, refusals, latency percentiles and output tok/s."""
    lines = ["| rate | target | attainment | of admitted | goodput req/s | refused | TTFT p50/p90/p99 ms "
             "| TPOT p50/p90/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms | out tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rates = sorted({r["offered_rate"] for rows in per_target.values() for r in rows})
    for rate in rates:
        for name, rows in per_target.items():
            for r in (r for r in rows if r["offered_rate"] == rate):
                lines.append(goodput_row(name, r))
    caps = {n: attainment_capacity(rows) for n, rows in per_target.items()}
    if any(c is not None for c in caps.values()):
        lines += ["", "Capacity (highest rate with >= 90% attainment, and every lower rate too): "
                  + ", ".join(f"{n} {c:g} req/s" for n, c in caps.items() if c is not None)]
    return "\n".join(lines)


def goodput_row(name: str, r: dict) -> str:
    def pct(key: str) -> str:
        return "-" if key not in r or math.isnan(r[key]) else f"{100 * r[key]:.0f}%"

    def dist(key: str, qs: tuple[str, ...]) -> str:
        return "/".join(_ms(r[key][q]) for q in qs)

    good = f"{r['goodput']:.2f}" if "goodput" in r else "-"
    return (f"| {r['offered_rate']:g} | {name} | {pct('attainment')} | {pct('attainment_admitted')} | {good} "
            f"| {r.get('refused', 0)} | {dist('ttft_ms', ('p50', 'p90', 'p99'))} "
            f"| {dist('tpot_ms', ('p50', 'p90', 'p99'))} | {dist('itl_ms', ('p50', 'p99'))} "
            f"| {dist('e2e_ms', ('p50', 'p99'))} | {r['output_throughput']:.1f} |")


def plot_title(servers: list[str], model: str) -> str:
    """Server(s), model, date and machine: a figure read without its JSON still says what it measured."""
    return f"{', '.join(servers)} | {model} | {time.strftime('%Y-%m-%d %H:%M')} | {cpu_model()}"


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
    for i, rate in enumerate(args.request_rate):
        summary, results = run_point(args.base_url, args, rate, f"rate {rate:g}", i)
        print_summary("target", summary)
        rows.append({**summary, "requests": [r.to_dict() for r in results]})
        timelines[f"rate {rate:g}"] = _itl_series(results)
    if args.goodput:
        print(goodput_table({args.base_url: rows}))
    path = _out_path(args, "bench")
    path.write_text(json.dumps({"args": args_record(args), "machine": cpu_model(), "points": rows}, indent=1))
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
    # a refused request counts as missing (num_requests is every request sent); the epsilon keeps 18 of 20 at 90%
    return _highest_passing_run(rows, lambda r: r["good_requests"] >= attainment * r["num_requests"] - 1e-9)


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
    path.write_text(json.dumps({"args": args_record(args), "machine": cpu_model(), **result}, indent=1))
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
