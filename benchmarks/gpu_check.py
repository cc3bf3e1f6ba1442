"""One prepared GPU check for a session lent an H200 (run through benchmarks/gpu_check.sh; 5 minutes at most).

1. measures the device-to-device copy rate (the bandwidth ceiling: bytes read + written / time);
2. builds the CUDA extension (kernels/csrc) and reports the build time;
3. runs `pytest -m gpu tests/kernels` in-process (every backend vs the float64 reference, poisoned outputs);
4. times each backend's decode attention with CUDA events (triton.testing.do_bench, median, L2 flushed):
   batch 1..256 x context 512..32k, 32 query heads : 8 KV heads, head_dim 128, block 16, bf16, and prints the
   achieved bandwidth (K/V bytes read / time) against the copy rate;
5. with --engine: the engine-throughput hook (another engineer's part; skipped if the API is missing).
Writes everything to $OUT/gpu_check.json when OUT is set. Needs no internet and no install: the repository
root
is mapped onto the `conveyor` package below.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEADLINE_S = float(os.environ.get("GPU_CHECK_DEADLINE_S", "270"))
T0 = time.monotonic()


def _map_package() -> None:
    """Make `conveyor.kernels` (ROOT/kernels) and `conveyor.serving` importable without `pip install`."""
    sys.path.insert(0, str(ROOT))
    import conveyor

    if str(ROOT) not in conveyor.__path__:
        # conveyor.X falls back to ROOT/X, as pyproject's package-dir maps it
        conveyor.__path__.append(str(ROOT))


def _time_left() -> float:
    return DEADLINE_S - (time.monotonic() - T0)


def copy_bandwidth(torch, gib: float = 2.0) -> float:  # noqa: ANN001 - torch module
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    import triton.testing

    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n // 2, device="cuda", dtype=torch.float32).view(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def build_extension() -> dict:
    from conveyor.kernels import cuda_ext

    start = time.monotonic()
    try:
        cuda_ext.load()
        return {"ok": True, "seconds": round(time.monotonic() - start, 1)}
    except Exception as exc:  # noqa: BLE001 - report any build failure and keep going
        return {"ok": False, "seconds": round(time.monotonic() - start, 1), "error": str(exc)[-3000:]}


def run_gpu_tests() -> dict:
    import pytest

    start = time.monotonic()
    code = pytest.main(["-m", "gpu", "-q", "-x", "--no-header", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "kernels")])
    return {"exit_code": int(code), "seconds": round(time.monotonic() - start, 1)}


def decode_inputs(torch, batch: int, context: int, cache: tuple, heads: int, kv_heads: int,  # noqa: ANN001
                  head_dim: int, block_size: int) -> dict:
    """Block tables into the shared random cache: each sequence gets random distinct blocks."""
    key_cache, value_cache = cache
    blocks = -(-context // block_size)
    perm = torch.randperm(key_cache.shape[0], device="cuda")[: batch * blocks]
    return {
        "query": torch.randn(batch, heads, head_dim, device="cuda", dtype=key_cache.dtype),
        "key_cache": key_cache, "value_cache": value_cache,
        "block_tables": perm.view(batch, blocks).int(),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
    }


def decode_fns(torch, inputs: dict, context: int, backends: list[str]) -> dict[str, Callable]:  # noqa: ANN001
    from conveyor.kernels import ops

    scale = inputs["query"].shape[-1] ** -0.5
    args = (inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"],
            inputs["seq_lens"], inputs["query_start_loc"], scale)
    fns: dict[str, Callable] = {}
    for name in backends:
        fns[name] = lambda name=name: ops.paged_attention(*args, max_query_len=1, max_seq_len=context,
                                                           backend=name)
    if "cuda" in backends:  # the split-K choice both ways, to check the heuristic
        from conveyor.kernels import cuda_ext

        for label, parts in (("cuda-1pass", 1), ("cuda-split", -(-context // cuda_ext.PARTITION_SIZE))):
            fns[label] = lambda parts=parts: cuda_ext.paged_decode(
                inputs["query"], inputs["key_cache"], inputs["value_cache"], inputs["block_tables"],
                inputs["seq_lens"], scale, context, num_partitions=parts)
    return fns


def time_decode(torch, copy_bps: float, quick: bool) -> list[dict]:  # noqa: ANN001
    import triton.testing

    from conveyor.kernels import ops

    heads, kv_heads, head_dim, block_size, dtype = 32, 8, 128, 16, torch.bfloat16
    batches = [1, 8, 32, 64, 128, 256] if not quick else [1, 64, 256]
    contexts = [512, 2048, 8192, 32768] if not quick else [512, 8192]
    max_tokens = 256 * 32768 // 2  # 17 GB of bf16 K+V; larger configs are skipped
    blocks = max_tokens // block_size + 64
    shape = (blocks, block_size, kv_heads, head_dim)
    cache = (torch.randn(shape, device="cuda", dtype=dtype), torch.randn(shape, device="cuda", dtype=dtype))
    backends = [b for b in ops.available_backends("cuda") if b not in ("reference", "torch")]
    rows = []
    for context in contexts:
        for batch in batches:
            if batch * context > max_tokens or _time_left() < 30:
                continue
            inputs = decode_inputs(torch, batch, context, cache, heads, kv_heads, head_dim, block_size)
            kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
            for name, fn in decode_fns(torch, inputs, context, backends).items():
                try:
                    ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                except Exception as exc:  # noqa: BLE001 - one failing backend must not stop the table
                    rows.append({"backend": name, "batch": batch, "context": context,
                                 "error": str(exc)[:300]})
                    continue
                bps = kv_bytes / (ms * 1e-3)
                rows.append({"backend": name, "batch": batch, "context": context, "ms": round(ms, 4),
                             "kv_gb_per_s": round(bps / 1e9, 1),
                             "fraction_of_copy": round(bps / copy_bps, 3)})
    return rows


def engine_benchmark(enabled: bool) -> dict:
    """HOOK for the engine owner: SmolLM2-shaped engine throughput on the GPU.

    Runs `conveyor.serving.bench.run_gpu_benchmark(deadline_s=...) -> dict` when --engine is given and that
    function exists; otherwise reports why it was skipped. Implement that function in serving/, not here.
    """
    if not enabled:
        return {"skipped": "pass --engine to run"}
    try:
        import conveyor.serving  # noqa: F401 - must import without ray
        from conveyor.serving import bench  # type: ignore[attr-defined]
        run = bench.run_gpu_benchmark
    except (ImportError, AttributeError) as exc:
        return {"skipped": f"engine benchmark API missing: {exc}"}
    return run(deadline_s=max(30.0, _time_left() - 10))


def print_table(rows: list[dict], copy_bps: float) -> None:
    print(f"\ncopy rate (read+write): {copy_bps / 1e9:.0f} GB/s")
    print(f"{'backend':12s} {'batch':>5s} {'ctx':>6s} {'ms':>9s} {'GB/s':>7s} {'of copy':>7s}")
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:12s} {r['batch']:5d} {r['context']:6d}  ERROR {r['error'][:60]}")
        else:
            print(f"{r['backend']:12s} {r['batch']:5d} {r['context']:6d} {r['ms']:9.4f} "
                  f"{r['kv_gb_per_s']:7.0f} "
                  f"{r['fraction_of_copy']:7.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="store_true", help="also run the engine throughput hook")
    parser.add_argument("--quick", action="store_true", help="fewer decode configs")
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    _map_package()
    import torch

    report: dict = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    report["device"] = torch.cuda.get_device_name()
    import triton

    report["triton"] = triton.__version__
    copy_bps = copy_bandwidth(torch)
    report["copy_gb_per_s"] = round(copy_bps / 1e9, 1)
    report["build"] = build_extension()
    print("cuda extension build:", report["build"], flush=True)
    if not args.skip_tests:
        report["tests"] = run_gpu_tests()
    report["decode"] = time_decode(torch, copy_bps, args.quick)
    report["engine"] = engine_benchmark(args.engine)
    report["elapsed_s"] = round(time.monotonic() - T0, 1)
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = pathlib.Path(out_dir) / "gpu_check.json"
        path.write_text(json.dumps(report, indent=1))
        print("wrote", path)
    print_table(report["decode"], copy_bps)
    print("build:", report["build"].get("ok"), "tests:", report.get("tests"), "engine:", report["engine"])
    return 0 if report["build"].get("ok") and report.get("tests", {}).get("exit_code", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
