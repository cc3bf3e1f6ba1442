"""`conveyor bench`'s arguments: the argparse types (a bad value is a usage error, exit 2, before any request
is sent) and the argument groups that `conveyor bench`, `conveyor bench compare` and benchmarks/ share."""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

from conveyor.bench.client import validate_base_url
from conveyor.bench.metrics import parse_goodput_spec
from conveyor.bench.workload import DATASETS

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
