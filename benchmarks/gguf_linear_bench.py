"""The GGUF-block linears by step size: GGUF's rows of blocks, the feature-interleaved copy, and oneDNN's packed
fp32, over a model's layer linears (cold weights: every layer's own, as a decode step reads them).

    .venv/bin/python benchmarks/gguf_linear_bench.py                       # SmolLM2's shapes, Q4_1, 30 layers
    .venv/bin/python benchmarks/gguf_linear_bench.py --type Q8_0 --shapes 49152x576 --layers 1   # its LM head
"""
from __future__ import annotations

import argparse
import time

import torch

from conveyor.kernels import gguf
from conveyor.serving.models.cpu_packing import PackedLinear

SMOLLM2 = "960x576,576x576,3072x576,576x1536"  # qkv, o, gate|up, down: (out, in)


def time_ms(fn, repeats: int) -> float:  # noqa: ANN001
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--type", default="Q4_1", choices=["Q4_1", "Q8_0"])
    p.add_argument("--shapes", default=SMOLLM2, help="OUTxIN per linear of one layer")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rows", default="1,2,3,4,6,8,16,32,64,128")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if not gguf.is_available():
        raise SystemExit("the CPU extension did not build")
    ggml_type = {"Q4_1": gguf.Q4_1, "Q8_0": gguf.Q8_0}[args.type]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    weights = []
    for _ in range(args.layers):
        for out_features, in_features in shapes:
            dense = torch.randn(out_features, in_features)
            weights.append((gguf.prepare(gguf.quantize(dense, ggml_type), ggml_type, in_features),
                            PackedLinear(dense, None)))
    flop_per_row = sum(2 * w.out_features * w.in_features for w, _ in weights)
    print(f"{args.type}, {len(weights)} linears, {torch.get_num_threads()} threads; ms per pass over all of them")
    print("| rows | GGUF rows | interleaved | packed fp32 | best GFLOP/s |\n|---|---|---|---|---|")
    for num_rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(num_rows, k) for k in {w.in_features for w, _ in weights}}
        kernels = {
            "rows": lambda w, x, _: torch.ops.conveyor_cpu.gguf_linear_rows(x, w.blocks, w.ggml_type, w.out_features),
            "interleaved": lambda w, x, _: torch.ops.conveyor_cpu.gguf_linear(x, w.q, w.scales, w.ggml_type,
                                                                         w.out_features),
            "packed": lambda w, x, dense: dense(x),
        }
        times = {name: time_ms(lambda k=kernel, xs=xs: [k(w, xs[w.in_features], d) for w, d in weights], args.repeats)
                 for name, kernel in kernels.items()}
        best = min(times.values())
        print(f"| {num_rows} | {times['rows']:.2f} | {times['interleaved']:.2f} | {times['packed']:.2f} | "
              f"{num_rows * flop_per_row / best / 1e6:.0f} |")


if __name__ == "__main__":
    main()
