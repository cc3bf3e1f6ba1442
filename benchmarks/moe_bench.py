"""Output tok/s of a tiny mixture-of-experts model against a dense model with the same active parameters.

Both are random-weight checkpoints built here by transformers' own classes (tests/tiny_model.py) in a temporary
folder: a Qwen3-MoE (by default hidden 512, 4 layers, 8 experts, top-2, moe_intermediate 256, every layer sparse)
and a dense Qwen3 whose MLP has intermediate = top_k * moe_intermediate, so a token multiplies by the same number of
weights in both; attention, vocabulary and everything else are equal. Both engines live in this process
(conveyor.serving.LLM) and take turns on the same prompts (random token ids, greedy, ignore_eos), round by round,
the order alternating, so the machine's drift hits both. Each batch size sends that many prompts together (the
decode steps then run that many rows); output tok/s = output tokens / wall time of the generate call (prefill
included). The figure is MoE / dense per batch size (issue 41's target: >= 0.7).

What to expect: both multiply each token by the same number of weights, but a step of B rows reads the weights of
up to min(E, B * top_k) experts (random routing spreads rows roughly evenly, as trained routers are made to),
where the dense model reads one MLP; at batch 1 the two read alike, at large batches the MoE reads E / top_k times
the MLP bytes, which costs where the step is bound by reading weights (CPU decode).

    .venv/bin/python -m benchmarks.moe_bench                                  # ~2-4 min on 2 cores
    .venv/bin/python -m benchmarks.moe_bench --batch-sizes 1,4 --prompt-len 16 --max-tokens 8 --rounds 1 --layers 1

Results go to --out (default benchmarks/out/moe_bench.json, git-ignored).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from conveyor.serving import LLM, SamplingParams

DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "moe_bench.json"


def build_pair(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The MoE and the dense checkpoint, equal but for the MLPs."""
    from tests.tiny_model import build_tiny_model

    common = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                  num_key_value_heads=max(1, args.hidden // 128), head_dim=64, tie_word_embeddings=False,
                  max_position_embeddings=max(512, args.prompt_len + args.max_tokens + 16))
    moe = build_tiny_model(root / "moe", "qwen3_moe", num_experts=args.experts, num_experts_per_tok=args.top_k,
                           moe_intermediate_size=args.moe_intermediate, mlp_only_layers=[], norm_topk_prob=True,
                           **common)
    dense = build_tiny_model(root / "dense", "qwen3", intermediate_size=args.top_k * args.moe_intermediate,
                             **common)
    return {"dense": dense, "moe": moe}


def active_params(llm: LLM, args: argparse.Namespace) -> tuple[int, int]:
    """(all parameters, those one token multiplies by: top_k of each sparse layer's experts). Counted from the
    engine's figure before packing (packed linears hold no nn.Parameter)."""
    total = llm.engine.num_params
    if getattr(llm.engine.hf_config, "model_type", None) != "qwen3_moe":
        return total, total
    idle_experts = (args.experts - args.top_k) * 3 * args.hidden * args.moe_intermediate * args.layers
    return total, total - idle_experts


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / elapsed


def run_rounds(llms: dict[str, LLM], prompts: list[list[int]], params: SamplingParams, rounds: int,
               salt: int) -> dict[str, list[float]]:
    """Output tok/s of each engine on the same prompts, `rounds` times, the order alternating."""
    runs: dict[str, list[float]] = {name: [] for name in llms}
    for round_index in range(rounds):
        order = list(llms) if round_index % 2 == 0 else list(reversed(llms))
        # A fresh first token each round: no run is served from an earlier one's prefix cache.
        salted = [[3 + (salt + round_index) % 200] + p[1:] for p in prompts]
        for name in order:
            runs[name].append(timed_generate(llms[name], salted, params))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--batch-sizes", default="1,8,32",
                        help="prompts sent together per run, one table row each (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per batch size (median)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default: %(default)s)")
    args = parser.parse_args()
    if args.hidden % 64:
        raise SystemExit("--hidden must be a multiple of 64 (head_dim 64)")
    batches = [int(b) for b in args.batch_sizes.split(",")]

    rows = []
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        dirs = build_pair(Path(tmp), args)
        llms = {name: LLM(str(path), dtype=args.dtype, max_num_seqs=max(batches)) for name, path in dirs.items()}
        params_of = {name: active_params(llm, args) for name, llm in llms.items()}
        for name, (total, active) in params_of.items():
            print(f"{name}: {total:,} parameters, {active:,} active per token")
        rng = random.Random(0)
        vocab = llms["dense"].engine.hf_config.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(max(batches))]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for llm in llms.values():  # warm-up: first-call costs (allocator, oneDNN kernels) out of the timings
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        print(f"\n{'batch':>5} {'dense tok/s':>12} {'MoE tok/s':>10} {'MoE/dense':>10}  runs (dense | MoE)")
        for i, batch in enumerate(batches):
            runs = run_rounds(llms, prompts[:batch], params, args.rounds, salt=i * args.rounds)
            dense, moe = statistics.median(runs["dense"]), statistics.median(runs["moe"])
            rows.append({"batch": batch, "dense_tok_per_s": dense, "moe_tok_per_s": moe, "ratio": moe / dense,
                         "runs": runs})
            print(f"{batch:>5} {dense:>12.1f} {moe:>10.1f} {moe / dense:>9.2f}x  "
                  f"{[round(r, 1) for r in runs['dense']]} | {[round(r, 1) for r in runs['moe']]}", flush=True)
    print(f"\nMoE / dense output tok/s at batch {rows[-1]['batch']}: {rows[-1]['ratio']:.2f}x (target >= 0.7x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    params_json = {name: {"params": t, "active_params": a} for name, (t, a) in params_of.items()}
    args.out.write_text(json.dumps({"settings": settings, "models": params_json, "rows": rows}, indent=1) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
