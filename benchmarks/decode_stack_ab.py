"""Decode steps of SmolLM2 (GGUF blocks) with their layers in one C++ call against layer by layer from Python.

Both engines live in this process and take turns, batch size by batch size, so the machine's drift hits both. A
decode step's time is (time of N + 4 output tokens - time of 4) / N, with 256-token prompts, so the prefill
cancels out. It first checks that greedy tokens are the same.

    .venv/bin/python -m benchmarks.decode_stack_ab                       # batch 1, 2, 4, 8, 16, 64; ~4 min
    .venv/bin/python -m benchmarks.decode_stack_ab --batch-sizes 1,4 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from conveyor.serving import LLM, SamplingParams

VARIANTS = {"python": False, "c++": True}


def decode_step_ms(llm: LLM, batch: int, num_steps: int) -> float:
    prompts = [[100 + (i * 37 + j) % 20000 for j in range(256)] for i in range(batch)]

    def run(num_tokens: int) -> float:
        params = SamplingParams(max_tokens=num_tokens, ignore_eos=True, temperature=0.0)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    return (run(num_steps + 4) - run(4)) / num_steps * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,64")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per batch size")
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    llms = {name: LLM(args.model, max_num_seqs=max(batches), cpu_decode_stack=on) for name, on in VARIANTS.items()}
    if llms["c++"].engine.model.decode_stack is None:
        raise SystemExit("the C++ decode stack does not apply to this model here (see the engine's log)")
    chat = ["What is the capital of France?", "Write a haiku about rain.", "def fibonacci(n):", "1, 1, 2, 3, 5,"]
    greedy = SamplingParams(max_tokens=48, temperature=0.0)
    tokens = {name: [r.token_ids for r in llm.generate(chat, greedy)] for name, llm in llms.items()}
    same = tokens["python"] == tokens["c++"]
    print(f"greedy tokens equal: {same}")
    rows = []
    for batch in batches:
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, llm in llms.items():
                times[name].append(decode_step_ms(llm, batch, args.steps))
        row = {"batch": batch, **{name: statistics.median(t) for name, t in times.items()}, "runs": times}
        rows.append(row)
        runs = {name: [round(x, 1) for x in t] for name, t in times.items()}
        print(f"batch {batch:3d}: python {row['python']:7.1f} ms  c++ {row['c++']:7.1f} ms  "
              f"({row['c++'] / row['python']:.2f}x)   runs {runs}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"greedy_tokens_equal": same, "rows": rows}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
