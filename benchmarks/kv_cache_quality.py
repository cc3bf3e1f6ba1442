"""What a narrower KV cache, or bf16 prefill matmuls, cost in output: greedy answers with each kv_cache_dtype (and
with `cpu_prefill_dtype: bfloat16`) against the all-float32 engine's.

SmolLM2-135M-Instruct (the default model, float32 weights), chat prompts of several kinds, greedy, answers as a
user gets them (up to EOS or --max-tokens). For each cache dtype: how many answers are identical to the float32
cache's, how far the answers agree before they first differ (the median and mean share of the longer answer's
tokens), and the share of positions that hold the same token.
A greedy answer diverges for good once one near-tie flips, so the prefix share is the
conservative figure; bfloat16 gives the yardstick of a cache whose rounding nobody notices.

    .venv/bin/python -m benchmarks.kv_cache_quality [--dtypes bfloat16,fp8_e4m3,fp8_e5m2] [--max-tokens 128]
        [--prefill-dtypes bfloat16]

All prompts go in one engine step (their prefill is one step of ~600 tokens), so `cpu_prefill_dtype` applies to it.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics

PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and German.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What is 17 times 23? Show your work.",
    "Write a short email asking for a meeting next week.",
    "What are the benefits of regular exercise?",
    "Describe how a bicycle works.",
    "Write a Python function that checks whether a number is even.",
    "What is the difference between weather and climate?",
]


def answers(max_tokens: int, kv_cache_dtype: str = "auto", cpu_prefill_dtype: str = "float32") -> list[list[int]]:
    from conveyor.serving import LLM, SamplingParams

    llm = LLM(model="smollm2", kv_cache_dtype=kv_cache_dtype, cpu_prefill_dtype=cpu_prefill_dtype,
              max_num_seqs=len(PROMPTS), max_num_batched_tokens=2048)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    token_ids = [list(r.token_ids) for r in results]
    del llm
    gc.collect()
    return token_ids


def agreement(want: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    prefixes, same = [], 0
    for w, g in zip(want, got, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(w, g, strict=False)) if a != b), min(len(w), len(g)))
        prefixes.append(n / max(len(w), len(g)))
        same += sum(a == b for a, b in zip(w, g, strict=False))  # up to the shorter answer
    total = sum(max(len(w), len(g)) for w, g in zip(want, got, strict=True))
    return {"identical": sum(w == g for w, g in zip(want, got, strict=True)), "answers": len(want),
            "prefix_median": statistics.median(prefixes), "prefix_mean": statistics.fmean(prefixes),
            "same_position": same / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bfloat16,fp8_e4m3,fp8_e5m2")
    parser.add_argument("--prefill-dtypes", default="", help="cpu_prefill_dtype values to compare (float32 cache)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json")
    args = parser.parse_args()
    reference = answers(args.max_tokens)
    rows = {}
    print("| setting | identical answers | agree before the first difference (median / mean) "
          "| same token at a position |")
    print("|---|---|---|---|")
    settings = [("kv_cache_dtype", d) for d in args.dtypes.split(",") if d]
    settings += [("cpu_prefill_dtype", d) for d in args.prefill_dtypes.split(",") if d]
    for key, value in settings:
        name = f"{key}={value}"
        row = rows[name] = agreement(reference, answers(args.max_tokens, **{key: value}))
        print(f"| {name} | {row['identical']} / {row['answers']} | {row['prefix_median']:.0%} / "
              f"{row['prefix_mean']:.0%} | {row['same_position']:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"max_tokens": args.max_tokens, "prompts": PROMPTS, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
