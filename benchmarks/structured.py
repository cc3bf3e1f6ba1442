"""Structured outputs: what constraining requests costs the engine, in process, on SmolLM2 (max batch 64).

1. Throughput: 64 chat requests, 128 output tokens each, with 0%, 50% and 100% of them constrained by the JSON
   schemas of tests/structured_cases.py (each wrapped as an array of at least 40 items, so a constrained output runs
   the full 128 tokens like an unconstrained one with ignore_eos: the comparison is the mask's cost, not shorter
   answers). Output tok/s per mix and its ratio to 0%, from one run; the mask's time per masked row and per step.
2. Compile: the grammar compile time (schema -> matcher, cold) p50/p99 over the test schemas and over 40 large
   generated schemas.
3. Never blocked: while 8 unconstrained requests decode, 12 requests with distinct large schemas (1500 fields)
   arrive; the step time before and while their compiles are pending (p50/max).

    .venv/bin/python -m benchmarks.structured                       # ~8 min on 2 cores
    .venv/bin/python -m benchmarks.structured --json benchmarks/out/structured.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from conveyor.serving import LLM, SamplingParams
from conveyor.serving.request import StructuredOutputsParams
from tests.structured_cases import SCHEMA_CASES

NUM_REQUESTS = 64
OUTPUT_TOKENS = 128


def long_schema(schema: dict) -> str:
    items = {k: v for k, v in schema.items() if k != "$defs"}
    wrapped = {"type": "array", "items": items, "minItems": 40}
    if "$defs" in schema:  # refs are "#/$defs/...": the definitions stay at the root
        wrapped["$defs"] = schema["$defs"]
    return json.dumps(wrapped)


def big_schema(i: int, num_fields: int = 150) -> str:
    """A distinct wide schema (num_fields typed properties): a slow compile, unlike anything cached."""
    kinds = [{"type": "string", "maxLength": 30}, {"type": "integer"}, {"type": "boolean"},
             {"enum": [f"v{i}_{k}" for k in range(8)]}, {"type": "array", "items": {"type": "number"}}]
    props = {f"field_{i}_{k}": kinds[k % len(kinds)] for k in range(num_fields)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)[: num_fields // 2]})


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def conversations() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"List examples of {SCHEMA_CASES[i % len(SCHEMA_CASES)].name} as JSON."}]
            for i in range(NUM_REQUESTS)]


def throughput(llm: LLM, fraction: float) -> dict:
    num_constrained = round(NUM_REQUESTS * fraction)
    params = []
    for i in range(NUM_REQUESTS):
        spec = (StructuredOutputsParams("json", long_schema(SCHEMA_CASES[i % len(SCHEMA_CASES)].schema))
                if i < num_constrained else None)
        params.append(SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=spec is None,
                                     structured=spec))
    bitmask = llm.engine.runner.grammar_bitmask
    masked_before = (bitmask.num_rows_masked, bitmask.total_s, bitmask.fill_s) if bitmask else (0, 0.0, 0.0)
    start = time.perf_counter()
    results = llm.chat(conversations(), params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(r.token_ids) for r in results)
    bitmask = llm.engine.runner.grammar_bitmask
    rows = (bitmask.num_rows_masked - masked_before[0]) if bitmask else 0
    mask_s = (bitmask.total_s - masked_before[1]) if bitmask else 0.0
    fill_s = (bitmask.fill_s - masked_before[2]) if bitmask else 0.0
    cut_short = sum(len(r.token_ids) < OUTPUT_TOKENS for r in results)
    return {"constrained_fraction": fraction, "output_tokens": num_tokens, "seconds": elapsed,
            "output_tok_s": num_tokens / elapsed, "masked_rows": rows, "mask_s": mask_s,
            "mask_us_per_row": 1e6 * mask_s / rows if rows else 0.0,
            "fill_us_per_row": 1e6 * fill_s / rows if rows else 0.0, "outputs_shorter_than_max": cut_short}


def compile_times(llm: LLM) -> dict:
    engine = llm.engine
    compiler = engine.grammar_compiler()
    before = len(compiler.compile_times_s)
    specs = [StructuredOutputsParams("json", json.dumps(c.schema)) for c in SCHEMA_CASES]
    specs += [StructuredOutputsParams("json", big_schema(1000 + i)) for i in range(40)]
    for spec in specs:
        grammar = compiler.submit(spec)
        while not grammar.poll() and not grammar.failed:
            grammar.wait(0.01)
    times = list(compiler.compile_times_s)[before:]
    small, big = times[:len(SCHEMA_CASES)], times[len(SCHEMA_CASES):]
    return {"test_schemas_ms": {"p50": 1e3 * percentile(small, 0.5), "p99": 1e3 * percentile(small, 0.99)},
            "big_schemas_ms": {"p50": 1e3 * percentile(big, 0.5), "p99": 1e3 * percentile(big, 0.99),
                               "num_fields": 150}}


def never_blocked(llm: LLM, num_fields: int = 1500) -> dict:
    """Steps of running requests while distinct large schemas compile off the step: the steps taken while some
    compile was pending, against the steps before."""
    engine = llm.engine
    plain = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    for i in range(8):
        engine.add_request(engine.make_request([5 + i] * 32, plain, f"plain-{i}"))
    for _ in range(20):  # prefill and warm
        engine.step()
    before = [engine.step()[1].step_time_s for _ in range(30)]
    compiled_before = engine.grammar_compiler().num_compiled
    requests = []
    for i in range(12):
        spec = StructuredOutputsParams("json", big_schema(2000 + i, num_fields))
        request = engine.make_request([7] * 16, SamplingParams(max_tokens=2, temperature=0.0, structured=spec))
        engine.add_request(request)
        requests.append(request)
    start = time.perf_counter()
    during = []
    while any(r.grammar.compiling for r in requests):
        during.append(engine.step()[1].step_time_s)
    compile_s = time.perf_counter() - start
    engine.abort_requests([f"plain-{i}" for i in range(8)])
    while engine.has_unfinished():
        engine.step()
    times = list(engine.grammar_compiler().compile_times_s)[compiled_before:]
    return {"num_fields": num_fields, "num_schemas": len(requests), "compiles_took_s": compile_s,
            "compile_ms_each": {"p50": 1e3 * percentile(times, 0.5), "max": 1e3 * max(times)},
            "step_ms_before": {"p50": 1e3 * statistics.median(before), "max": 1e3 * max(before)},
            "step_ms_while_compiling": {"p50": 1e3 * statistics.median(during), "max": 1e3 * max(during),
                                        "num_steps": len(during)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--fractions", default="0,0.5,1")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=NUM_REQUESTS)
    # Warm-up, as `conveyor serve` is warm: its engine builds the grammar view of the tokenizer at start-up.
    warm_spec = StructuredOutputsParams("json_object")
    llm.chat(conversations()[:4], [SamplingParams(max_tokens=8, structured=warm_spec if i else None) for i in range(4)])
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "runs": []}
    fractions = [float(f) for f in args.fractions.split(",")]
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits every mix alike
        for fraction in fractions:
            row = throughput(llm, fraction)
            result["runs"].append(row)
            print(f"constrained {fraction:4.0%}: {row['output_tok_s']:6.1f} output tok/s ({row['output_tokens']} "
                  f"tokens, {row['seconds']:.1f} s), mask {row['mask_us_per_row']:.0f} us/row (fill "
                  f"{row['fill_us_per_row']:.0f}) over "
                  f"{row['masked_rows']} rows, {row['outputs_shorter_than_max']} outputs ended early", flush=True)
    medians = {f: statistics.median(r["output_tok_s"] for r in result["runs"] if r["constrained_fraction"] == f)
               for f in fractions}
    result["median_tok_s"] = {str(f): v for f, v in medians.items()}
    result["ratio_to_unconstrained"] = {str(f): v / medians[fractions[0]] for f, v in medians.items()}
    print("median output tok/s:", {f"{f:.0%}": round(v, 1) for f, v in medians.items()},
          "ratio:", {f"{f:.0%}": round(v / medians[fractions[0]], 3) for f, v in medians.items()})
    result["compile"] = compile_times(llm)
    print("compile ms:", json.dumps(result["compile"]))
    result["never_blocked"] = never_blocked(llm)
    print("steps while large schemas compile:", json.dumps(result["never_blocked"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
