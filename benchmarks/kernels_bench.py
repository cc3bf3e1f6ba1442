"""CPU kernel micro-benchmarks, one subcommand each; every one prints a table of median times on stdout.

    decode-attention  decode attention: the "torch" backend (index_select gathers) against "cpu" (the C++ kernel),
                      one layer of a pure decode step through ops.paged_attention, batch x context grid
    chunk-attention   a prefill chunk's attention: the decode kernel row by row (what backend "cpu" does for chunks
                      up to cpu_plan.MAX_CHUNK_AS_DECODE_ROWS tokens), the prefill kernel (longer chunks) and
                      torch's SDPA over the gathered context (the torch backend)
    kv-dtype          decode attention over all 30 layers from DRAM with float32, bfloat16 and fp8 KV caches
                      (each layer its own cache, blocks in random order), interleaved in one run
    gguf-linear       a model's GGUF-block layer linears by step rows: GGUF's rows of blocks, the feature-interleaved
                      copy and oneDNN's packed fp32 (cold weights: every layer's own, as a decode step reads them);
                      where bf16 is native also the interleaved copy with bf16 products and oneDNN's packed bf16
                      (cpu_prefill_dtype bfloat16's two paths), with AVX512-VNNI or AVX2 the int8 kernel (int8's)

Shapes are SmolLM2-135M's (9 query heads : 3 KV heads, head_dim 64, block 16, float32) unless an option says
otherwise. Needs the C++ CPU extension (built at set-up). Run from the repository root:

    .venv/bin/python -m benchmarks.kernels_bench decode-attention [--threads 2] [--batches 1 4 16 32] [--contexts ...]
    .venv/bin/python -m benchmarks.kernels_bench chunk-attention [--threads 2] [--chunks 4 16 64 512] [--contexts ...]
    .venv/bin/python -m benchmarks.kernels_bench kv-dtype [--batches 1 16 64] [--context 300] [--block-size 16]
    .venv/bin/python -m benchmarks.kernels_bench gguf-linear [--rows 1,16,64]       # SmolLM2's shapes, Q4_1
    .venv/bin/python -m benchmarks.kernels_bench gguf-linear --type Q8_0 --shapes 49152x576 --layers 1   # LM head
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYERS = 30  # SmolLM2-135M
SMOLLM2_LINEARS = "960x576,576x576,3072x576,576x1536"  # qkv, o, gate|up, down: (out, in)


def median_ms(fn: Callable[[], object], budget_s: float = 0.0, min_reps: int = 20, max_reps: int = 2000) -> float:
    """Median wall time of fn in ms over min_reps runs, or as many as fit in budget_s (after two warm-up calls)."""
    fn()
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def decode_attention(args: argparse.Namespace) -> None:
    from conveyor.kernels import ops
    from tests.kernels.cases import make_case, rel_err

    if "cpu" not in ops.available_backends("cpu"):
        sys.exit("the cpu backend is unavailable here (the C++ extension does not build)")
    print(f"H={HEADS} KVH={KV_HEADS} D={HEAD_DIM} block={BLOCK} float32, {args.threads} threads, median ms/call")
    print(f"{'batch':>5} {'context':>7} {'torch':>9} {'cpu':>9} {'speedup':>8} {'rel diff':>9}")
    for batch in args.batches:
        for context in args.contexts:
            case = make_case([(1, context)] * batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK, poison_tail=False, seed=batch)

            def run(backend: str, case=case) -> torch.Tensor:  # noqa: ANN001
                return ops.paged_attention(*case.args(), **case.kwargs(), backend=backend, finite_cache=True)

            diff = rel_err(run("cpu"), run("torch"))
            torch_ms = median_ms(lambda: run("torch"), args.budget_s, min_reps=5)
            cpu_ms = median_ms(lambda: run("cpu"), args.budget_s, min_reps=5)
            print(f"{batch:>5} {context:>7} {torch_ms:>9.3f} {cpu_ms:>9.3f} {torch_ms / cpu_ms:>7.1f}x {diff:>9.1e}")


def chunk_attention(args: argparse.Namespace) -> None:
    from conveyor.kernels import cpu_plan, ops, torch_native

    torch.manual_seed(0)
    num_blocks = max(args.contexts) // BLOCK + 8
    key_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    value_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    scale = HEAD_DIM ** -0.5
    ext = ops._cpu_ext()  # noqa: SLF001
    print(f"{'context':>8} {'chunk':>6} {'sdpa+gather ms':>15} {'decode rows ms':>15} {'prefill ms':>11} "
          f"{'rows x':>7} {'prefill x':>9} {'max diff':>9}")
    for context in args.contexts:
        table = torch.randperm(num_blocks)[: -(-context // BLOCK)].to(torch.int32).unsqueeze(0)
        for chunk in (c for c in args.chunks if c <= context):
            query = torch.randn(chunk, HEADS, HEAD_DIM)
            rows = cpu_plan.decode_rows(table, [chunk], [context])
            sdpa = functools.partial(torch_native._prefill_one, query, key_cache, value_cache,  # noqa: SLF001
                                     table[0], context, scale)
            decode_rows = functools.partial(ext.paged_decode, query, key_cache, value_cache, rows[0], rows[1], scale)
            lens = torch.tensor([context], dtype=torch.int32)
            prefill = functools.partial(ext.paged_prefill, query, key_cache, value_cache, table, lens,
                                        torch.zeros(1, dtype=torch.int32), torch.tensor([chunk], dtype=torch.int32),
                                        scale)
            expected = sdpa()
            diff = max((expected - f()).abs().max().item() for f in (decode_rows, prefill))
            base, rows_ms, prefill_ms = median_ms(sdpa), median_ms(decode_rows), median_ms(prefill)
            print(f"{context:>8} {chunk:>6} {base:>15.3f} {rows_ms:>15.3f} {prefill_ms:>11.3f} "
                  f"{base / rows_ms:>6.1f}x {base / prefill_ms:>8.1f}x {diff:>9.1e}")


def kv_dtype(args: argparse.Namespace) -> None:
    from conveyor.kernels import cpu_ext
    from conveyor.kernels.reference import to_cache_dtype

    cpu_ext.load()
    block = args.block_size
    for batch in args.batches:
        blocks_per_seq = -(-args.context // block)
        num_blocks = batch * blocks_per_seq + 8
        tables = torch.randperm(num_blocks)[: batch * blocks_per_seq].reshape(batch, blocks_per_seq).to(torch.int32)
        lens = torch.full((batch,), args.context, dtype=torch.int32)
        shape = (num_blocks, block, KV_HEADS, HEAD_DIM)
        fp32 = [(torch.randn(shape), torch.randn(shape)) for _ in range(LAYERS)]
        caches = {"float32": fp32, "bfloat16": [(k.bfloat16(), v.bfloat16()) for k, v in fp32]}
        for name in ("float8_e4m3fn", "float8_e5m2"):
            dtype = getattr(torch, name)
            caches[name] = [(to_cache_dtype(k, dtype), to_cache_dtype(v, dtype)) for k, v in fp32]
        query = torch.randn(batch, HEADS, HEAD_DIM)
        out = torch.empty_like(query)

        def step(name: str, caches=caches, tables=tables, lens=lens, query=query, out=out) -> None:  # noqa: ANN001
            for k, v in caches[name]:
                cpu_ext.paged_decode(query, k, v, tables, lens, HEAD_DIM ** -0.5, out=out)

        times: dict[str, list[float]] = {name: [] for name in caches}
        for name in caches:
            step(name)
        for _ in range(args.reps):  # interleaved, so drift on a shared machine hits every dtype alike
            for name in caches:
                start = time.perf_counter()
                step(name)
                times[name].append(time.perf_counter() - start)
        result = {name: statistics.median(t) for name, t in times.items()}
        cells = []
        for name, seconds in result.items():
            nbytes = LAYERS * 2 * batch * args.context * KV_HEADS * HEAD_DIM * torch.empty(
                (), dtype=getattr(torch, name)).element_size()
            cells.append(f"{name} {seconds * 1e3:7.2f} ms ({nbytes / 1e6:5.0f} MB, {nbytes / seconds / 1e9:5.1f} GB/s)")
        speedups = "  ".join(f"{name} {result['float32'] / result[name]:.2f}x" for name in result if name != "float32")
        print(f"batch {batch:3d} x context {args.context}, block {block}: " + "\n  ".join(cells)
              + f"\n  speed-up over float32: {speedups}")


def gguf_linear(args: argparse.Namespace) -> None:
    from conveyor.kernels import gguf
    from conveyor.serving.models.cpu_packing import Bfloat16PackedLinear, PackedLinear, packable_dtypes
    from tests.tiny_model import quantize

    if not gguf.is_available():
        sys.exit("the CPU extension did not build")
    ggml_type = {"Q4_1": gguf.Q4_1, "Q8_0": gguf.Q8_0}[args.type]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    bf16 = gguf.has_bf16_kernel() and torch.bfloat16 in packable_dtypes()
    int8 = gguf.has_int8_kernel()
    weights = []
    for _ in range(args.layers):
        for out_features, in_features in shapes:
            dense = torch.randn(out_features, in_features)
            packed = {"fp32": PackedLinear(dense, None)} | ({"bf16": Bfloat16PackedLinear(dense, None)} if bf16 else {})
            prepared = gguf.prepare(quantize(dense, ggml_type), ggml_type, in_features)
            if int8:
                packed["int8"] = gguf.prepare_int8(prepared)
            weights.append((prepared, packed))
    flop_per_row = sum(2 * w.out_features * w.in_features for w, _ in weights)
    kernels = {
        "GGUF rows": lambda w, x, _: torch.ops.conveyor_cpu.gguf_linear_rows(x, w.blocks, w.ggml_type, w.out_features),
        "interleaved": lambda w, x, _: torch.ops.conveyor_cpu.gguf_linear(x, w.q, w.scales, w.ggml_type,
                                                                     w.out_features),
        "packed fp32": lambda w, x, dense: dense["fp32"](x),
    }
    if bf16:
        kernels["interleaved bf16"] = lambda w, x, _: torch.ops.conveyor_cpu.gguf_linear_bf16(
            x, w.q, w.scales, w.ggml_type, w.out_features)
        kernels["packed bf16"] = lambda w, x, dense: dense["bf16"](x)
    if int8:
        kernels["int8"] = lambda w, x, dense: gguf.gguf_linear_int8(x, dense["int8"])
    print(f"{args.type}, {len(weights)} linears, {torch.get_num_threads()} threads; ms per pass over all of them")
    print("| rows | " + " | ".join(kernels) + " | best GFLOP/s |\n|" + "---|" * (len(kernels) + 2))
    for num_rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(num_rows, k) for k in {w.in_features for w, _ in weights}}
        times = {name: median_ms(lambda k=kernel, xs=xs: [k(w, xs[w.in_features], d) for w, d in weights],
                                 min_reps=args.repeats)
                 for name, kernel in kernels.items()}
        best = min(times.values())
        print(f"| {num_rows} | " + " | ".join(f"{t:.2f}" for t in times.values())
              + f" | {num_rows * flop_per_row / best / 1e6:.0f} |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the engine's default on 2 cores)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("decode-attention", help="decode attention, torch backend against the C++ kernel")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[300, 1000, 2000])
    p.add_argument("--budget-s", type=float, default=0.5, help="timing budget per backend and point")
    p.set_defaults(fn=decode_attention)

    p = sub.add_parser("chunk-attention", help="a prefill chunk's attention: decode rows, prefill kernel, SDPA")
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128, 512])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048])
    p.set_defaults(fn=chunk_attention)

    p = sub.add_parser("kv-dtype", help="decode attention over 30 layers by KV cache dtype")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--block-size", type=int, default=16, help="tokens per cache block (the engine's default: 16)")
    p.set_defaults(fn=kv_dtype)

    p = sub.add_parser("gguf-linear", help="GGUF layer linears by rows: GGUF rows, interleaved, packed, int8")
    p.add_argument("--type", default="Q4_1", choices=["Q4_1", "Q8_0"])
    p.add_argument("--shapes", default=SMOLLM2_LINEARS, help="OUTxIN per linear of one layer")
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--rows", default="1,2,3,4,6,8,16,32,64,128")
    p.add_argument("--repeats", type=int, default=5)
    p.set_defaults(fn=gguf_linear)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    args.fn(args)


if __name__ == "__main__":
    main()
