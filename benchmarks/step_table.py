"""Step time against its make-up: B running decodes plus a prefill chunk of C tokens, in process (LLMEngine).

For every B, B short requests are started and decoded until they all run; then a long prompt arrives and the token
budget is set to B + C, so each following step carries exactly the B decodes and C tokens of that prompt. The median
of --repeat such steps is the cell. `--split both` measures each cell with mixed steps split in two forwards
(EngineConfig.split_mixed_steps; off by default) and without, interleaved. The JSON it writes is a table
benchmarks/slo_sim.py reads with --table. Run alone on a quiet machine (2 cores: anything beside it is measured too).

    .venv/bin/python -m benchmarks.step_table                                 # ~3 min on 2 cores
    .venv/bin/python -m benchmarks.step_table --decodes 1,32 --prefill 0,16,64 --split both
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import random
import statistics
import time
from pathlib import Path

DEFAULT_DECODES = "1,16,32,56"
DEFAULT_PREFILL = "0,8,16,32,48,64,65,96,128,256"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def make_engine(model: str, split: bool, cpu_prefill_dtype: str = "float32"):  # noqa: ANN201 - LLMEngine (torch)
    from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from conveyor.serving.engine import LLMEngine

    # No latency targets: the budget is exactly what each cell sets.
    scheduler = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=128, tpot_slo_ms=None, ttft_slo_ms=None)
    return LLMEngine(EngineConfig(model=ModelConfig(model=model), cache=CacheConfig(num_blocks=4096),
                                  scheduler=scheduler, split_mixed_steps=split, cpu_prefill_dtype=cpu_prefill_dtype))


def _set_budget(scheduler, num_tokens: int) -> None:  # noqa: ANN001 - Scheduler
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=num_tokens)
    scheduler.budget.config = scheduler.config


def time_cell(engine, num_decodes: int, num_prefill: int, repeat: int) -> float:  # noqa: ANN001
    """Median seconds of a step with num_decodes decodes and a num_prefill-token chunk of one prompt."""
    from conveyor.serving.request import SamplingParams

    scheduler = engine.scheduler
    _set_budget(scheduler, 4096)
    stream = SamplingParams(max_tokens=4 * repeat + 64, temperature=0.0, ignore_eos=True)
    rng = random.Random(f"{num_decodes}/{num_prefill}/{id(engine)}")  # unique prompts: no prefix-cache hits

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    for _ in range(num_decodes):
        engine.add_request(engine.make_request(prompt(32), stream))
    while scheduler.waiting or any(not r.output_token_ids for r in scheduler.running):
        engine.step()
    if num_prefill:
        long_prompt = prompt(num_prefill * (repeat + 2))
        engine.add_request(engine.make_request(long_prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    _set_budget(scheduler, num_decodes + num_prefill)
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        _, stats = engine.step()
        times.append(time.perf_counter() - start)
        if (stats.num_decode_tokens, stats.num_prefill_tokens) != (num_decodes, num_prefill):
            raise RuntimeError(f"a step of B={num_decodes} C={num_prefill} carried "
                               f"{stats.num_decode_tokens} decodes and {stats.num_prefill_tokens} prefill tokens")
    engine.abort_requests(list(scheduler.requests))
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--decodes", default=DEFAULT_DECODES, help="B values, comma-separated")
    parser.add_argument("--prefill", default=DEFAULT_PREFILL, help="C values, comma-separated")
    parser.add_argument("--repeat", type=int, default=7, help="steps timed per cell (the median is kept)")
    parser.add_argument("--split", choices=["on", "off", "both"], default="on")
    parser.add_argument("--cpu-prefill-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/step_table.json"), help="(git-ignored)")
    args = parser.parse_args()
    decodes = [int(x) for x in args.decodes.split(",")]
    prefill = [int(x) for x in args.prefill.split(",")]
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.split]
    engines = {split: make_engine(args.model, split, args.cpu_prefill_dtype) for split in modes}
    tables = {split: [[0.0] * len(prefill) for _ in decodes] for split in modes}
    for i, b in enumerate(decodes):
        for j, c in enumerate(prefill):
            for split in modes:  # interleaved: both see the same moment of a drifting VM
                tables[split][i][j] = 1000 * time_cell(engines[split], b, c, args.repeat)
            print(f"B={b:3d} C={c:4d} " + "  ".join(f"split={'on' if s else 'off'} {tables[s][i][j]:7.1f} ms"
                                                 for s in modes), flush=True)
    result = {"cpu": cpu_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
              "model": args.model, "cpu_prefill_dtype": args.cpu_prefill_dtype, "decode_knots": decodes,
              "prefill_knots": prefill,
              "step_ms": tables[modes[0]], "step_ms_by_split": {str(s): tables[s] for s in modes}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
