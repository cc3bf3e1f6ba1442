"""Simulate the scheduler's SLO policies on a measured step-cost table, to compare policies in seconds.

The real Scheduler, KV cache manager, step budget and step-cost fit run on a simulated clock; each step's time is
read from a table of step times measured on one CPU (LLMEngine on SmolLM2: B decodes plus prefill chunks of C
tokens; by default machine E's in benchmarks/results), so a policy change shows its effect on TTFT, TPOT, refusals
and goodput without an hour of served runs on a quiet machine. It leaves out what the table does not hold
(attention over long contexts, host jitter, the ingress, the way back to the client); the served sweep
(benchmarks/goodput.py) is the measurement that counts.

    .venv/bin/python -m benchmarks.slo_sim                                   # the issue-38 workload, 3 policies
    .venv/bin/python -m benchmarks.slo_sim --rates 1,2 --config fixed=tpot_slo_ms=none,ttft_slo_ms=none
    .venv/bin/python -m benchmarks.slo_sim --table benchmarks/out/step_table.json   # this machine's steps
    .venv/bin/python -m benchmarks.slo_sim --goodput-points --rates 2,2,2 --num-prompts 80 --warmup-s 20

--goodput-points replays the very requests of a `benchmarks.goodput` sweep with the same --rates, --num-prompts,
--warmup-s and --seed (conveyor/bench/runner.py plan_point: each point's warm-up, then its measured requests; only
those count), so a served point's attainment can be set beside the simulated one on the same prompts and arrivals.
--step-scale multiplies every step time: served steps ran 1.10-1.20x the table at 2 req/s (RESULTS.md).
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from conveyor.bench.runner import plan_point
from conveyor.bench.workload import arrival_offsets, derive_seed, lognormal_lengths
from conveyor.serving.admission import QueueFullError
from conveyor.serving.config import SchedulerConfig
from conveyor.serving.kv_cache_manager import KVCacheManager
from conveyor.serving.outputs import ModelRunnerOutput, SchedulerOutput
from conveyor.serving.request import Request, SamplingParams
from conveyor.serving.scheduler import Scheduler

# Step times measured on machine E by benchmarks/step_table.py (RESULTS.md, "Step cost"), split_mixed_steps off
# as by default: rows B decodes, columns C prefill tokens. Beyond the last knot the last segment's slope continues.
DEFAULT_TABLE = Path(__file__).parent / "results" / "step_table_2026-12-04_E.json"
BASE_CONFIG = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "max_waiting_requests": 256}
DEFAULT_CONFIGS = ("slo=", "queue=admission_policy=queue", "fixed=tpot_slo_ms=none,ttft_slo_ms=none")


def _interp(knots: tuple[int, ...], values: list[float], x: float) -> float:
    i = min(max(bisect.bisect_right(knots, x) - 1, 0), len(knots) - 2)
    x0, x1 = knots[i], knots[i + 1]
    return values[i] + (values[i + 1] - values[i]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class StepTable:
    decode_knots: tuple[int, ...]
    prefill_knots: tuple[int, ...]
    step_ms: tuple[tuple[float, ...], ...]

    @classmethod
    def load(cls, path: str | Path = DEFAULT_TABLE) -> StepTable:
        """A table that benchmarks/step_table.py wrote (this machine's, measured alone); of a `--split both` run,
        the one without split mixed steps (the default)."""
        data = json.loads(Path(path).read_text())
        step_ms = data.get("step_ms_by_split", {}).get("False", data["step_ms"])
        return cls(tuple(data["decode_knots"]), tuple(data["prefill_knots"]), tuple(tuple(row) for row in step_ms))

    def scaled(self, factor: float) -> StepTable:
        """The same table with every step `factor` times as long."""
        return StepTable(self.decode_knots, self.prefill_knots,
                         tuple(tuple(ms * factor for ms in row) for row in self.step_ms))

    def step_seconds(self, num_decodes: int, num_prefill: int) -> float:
        """The table's step time, interpolated in C for every row of B, then in B."""
        by_decodes = [_interp(self.prefill_knots, list(row), num_prefill) for row in self.step_ms]
        return _interp(self.decode_knots, by_decodes, max(num_decodes, 1)) / 1000


@dataclass
class Outcome:
    arrival: float
    num_output: int
    refused: bool = False
    token_times: list[float] = field(default_factory=list)

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        if self.refused or not self.token_times:
            return False
        ttft = self.token_times[0] - self.arrival
        tpot = ((self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)
                if len(self.token_times) > 1 else 0.0)
        return ttft <= ttft_s and tpot <= tpot_s


def simulate(config: SchedulerConfig, lengths: list[tuple[int, int]], offsets: list[float], table: StepTable,
             seed: int = 0) -> list[Outcome]:
    kv = KVCacheManager(num_blocks=8192, block_size=16, enable_prefix_caching=True)
    scheduler = Scheduler(config, kv, max_model_len=8192)
    now = [0.0]
    scheduler.clock = lambda: now[0]
    rng = random.Random(seed)
    outcomes = [Outcome(t, o) for t, (_, o) in zip(offsets, lengths, strict=True)]
    by_id: dict[str, Outcome] = {}
    pending = deque(enumerate(zip(offsets, lengths, strict=True)))
    while pending or scheduler.has_unfinished():
        while pending and pending[0][1][0] <= now[0]:
            i, (arrival, (prompt_len, output_len)) = pending.popleft()
            prompt = [rng.randrange(1000, 49000) for _ in range(prompt_len)]
            request = Request(str(i), prompt, SamplingParams(max_tokens=output_len, ignore_eos=True),
                              eos_token_id=None, max_tokens=output_len, arrival_time=arrival)
            try:
                scheduler.add_request(request)
                by_id[request.request_id] = outcomes[i]
            except QueueFullError:
                outcomes[i].refused = True
        if not scheduler.has_unfinished():
            now[0] = pending[0][1][0]
            continue
        _run_step(scheduler, scheduler.schedule(), now, by_id, table)
    return outcomes


def _run_step(scheduler: Scheduler, sched: SchedulerOutput, now: list[float], by_id: dict[str, Outcome],
              table: StepTable) -> None:
    num_decodes = sum(1 for c in sched.chunks if c.num_tokens == 1)
    seconds = table.step_seconds(num_decodes, sched.num_scheduled_tokens - num_decodes) if sched.chunks else 1e-3
    now[0] += seconds
    scheduler.observe_step(sched, seconds)
    sampled = {c.request.request_id: 1 + c.end % 97 for c in sched.chunks if c.samples}
    for request in scheduler.update(sched, ModelRunnerOutput(sampled)):
        if request.first_token_time is None:
            request.first_token_time = now[0]
        by_id[request.request_id].token_times.append(now[0])


def parse_config(text: str) -> tuple[str, dict[str, object]]:
    """NAME=key=value,key=value (values: numbers, none, words)."""
    name, _, rest = text.partition("=")
    overrides: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        overrides[key] = _value(value)
    return name, overrides


def _value(text: str) -> object:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(name: str, rate: float, outcomes: list[Outcome], warmup_s: float, ttft_s: float, tpot_s: float) -> str:
    counted = [o for o in outcomes if o.arrival >= warmup_s]
    admitted = [o for o in counted if not o.refused]
    met = sum(o.meets(ttft_s, tpot_s) for o in counted)
    ttfts = [o.token_times[0] - o.arrival for o in admitted]
    tpots = [(o.token_times[-1] - o.token_times[0]) / (len(o.token_times) - 1) for o in admitted
             if len(o.token_times) > 1]
    return (f"| {name} | {rate:g} | {met / len(counted):.0%} | {met / max(len(admitted), 1):.0%} "
            f"| {len(counted) - len(admitted)} | {rate * met / len(counted):.2f} "
            f"| {_percentile(ttfts, .5):.2f} / {_percentile(ttfts, .9):.2f} / {_percentile(ttfts, .99):.2f} "
            f"| {1000 * _percentile(tpots, .5):.0f} / {1000 * _percentile(tpots, .9):.0f} / "
            f"{1000 * _percentile(tpots, .99):.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1,1.5,2,2.5,3", help="offered req/s, comma-separated")
    parser.add_argument("--num-prompts", type=int, default=600, help="per rate point (warm-up included)")
    parser.add_argument("--warmup-s", type=float, default=30.0, help="arrivals before this are left out")
    parser.add_argument("--config", action="append", default=None,
                        help="NAME=key=value,... over SchedulerConfig (repeatable); default: slo, queue, fixed")
    parser.add_argument("--ttft-s", type=float, default=2.0)
    parser.add_argument("--tpot-ms", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--goodput-points", action="store_true",
                        help="replay benchmarks.goodput's requests for these --rates (point i: its i-th rate)")
    parser.add_argument("--step-scale", type=float, default=1.0, help="multiply every step time by this")
    parser.add_argument("--table", default=None, help="a step_table.py JSON (default: machine E's, benchmarks/results)")
    args = parser.parse_args()
    table = StepTable.load(args.table or DEFAULT_TABLE)
    if args.step_scale != 1.0:
        table = table.scaled(args.step_scale)
    configs = [parse_config(c) for c in (args.config or DEFAULT_CONFIGS)]
    print("| config | rate | attainment | of admitted | refused | goodput | TTFT p50/p90/p99 s | TPOT p50/p90/p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for index, rate in enumerate(float(r) for r in args.rates.split(",")):
        lengths, offsets, warmup_s = _point(args, index, rate)
        for name, overrides in configs:
            config = SchedulerConfig(**(BASE_CONFIG | overrides))
            outcomes = simulate(config, lengths, offsets, table, args.seed)
            print(report(name, rate, outcomes, warmup_s, args.ttft_s, args.tpot_ms / 1000), flush=True)


def goodput_args(num_prompts: int, warmup_s: float, seed: int) -> argparse.Namespace:
    """benchmarks.goodput's settings at its defaults but these: the workload its sweep draws."""
    from benchmarks.goodput import build_parser  # late: only --goodput-points needs the sweep's parser

    return build_parser().parse_args(["--num-prompts", str(num_prompts), "--warmup-s", str(warmup_s),
                                      "--seed", str(seed)])


def _point(args: argparse.Namespace, index: int, rate: float) -> tuple[list[tuple[int, int]], list[float], float]:
    """A rate point's (prompt, output) lengths, arrival offsets, and the arrival time before which none counts."""
    if not args.goodput_points:
        lengths = lognormal_lengths(args.num_prompts, derive_seed(args.seed, rate, "lengths"))
        offsets = arrival_offsets(args.num_prompts, rate, seed=derive_seed(args.seed, rate, "arrivals"))
        return lengths, offsets, args.warmup_s
    plan = plan_point(goodput_args(args.num_prompts, args.warmup_s, args.seed), rate, index)
    lengths = [(len(r.prompt_token_ids), r.max_tokens) for r in plan.requests]
    # The measured requests arrive from window_start_s on, the warm-up's before it.
    return lengths, plan.offsets, plan.window_start_s


if __name__ == "__main__":
    main()
