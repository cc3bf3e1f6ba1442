"""One prepared GPU check for a session lent an H200 (run through benchmarks/gpu_check.sh; 5 minutes at most).

1. measures the device-to-device copy rate (the bandwidth ceiling: bytes read + written / time);
2. builds the CUDA extension (conveyor/kernels/csrc) and reports the build time;
3. runs `pytest -m gpu tests/kernels tests/serving/test_cuda_graphs.py` in-process (every backend vs the float64
   reference, poisoned outputs; CUDA-graph replay vs eager);
4. times each backend's decode attention with CUDA events (triton.testing.do_bench, median, L2 flushed):
   batch 1..256 x context 512..32k, 32 query heads : 8 KV heads, head_dim 128, block 16, bf16, and prints the
   achieved bandwidth (K/V bytes read / time) against the copy rate;
5. with --engine (run before 4, which fills the time left): SmolLM2-shaped engine throughput (random bf16
   weights, 64 prompts x 128 in x 128 out, greedy) with CUDA graphs on and off, and with graphs and async
   scheduling on (conveyor/serving/step_pipeline.py: step N+1 scheduled while step N runs).
Writes everything to $OUT/gpu_check.json when OUT is set. Needs no internet and no install: run as a module from
the repository root (`python3 -m benchmarks.gpu_check`, as gpu_check.sh does), Python finds `conveyor` there.
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
                        str(ROOT / "tests" / "kernels"), str(ROOT / "tests" / "serving" / "test_cuda_graphs.py")])
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


# SmolLM2-135M's shapes (its config.json): the real weights cannot travel to the device, random ones at the same
# shapes cost the same per step.
SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)


def build_smollm2_shaped(path: pathlib.Path, device: str = "cuda", **overrides) -> pathlib.Path:  # noqa: ANN003
    """A random-weight bf16 Llama with SmolLM2-135M's shapes and a word-level tokenizer covering all its ids."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "<|im_end|>": 2, **{f"t{i}": i for i in range(3, SMOLLM2_SHAPES["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>",
                            pad_token="<|im_end|>").save_pretrained(path)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**{**SMOLLM2_SHAPES, **overrides})).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


def _engine_pass(engine, seed: int, num_prompts: int, prompt_len: int,  # noqa: ANN001 - LLMEngine
                 max_tokens: int) -> tuple[float, int, list[float], list[float]]:
    """One offline pass; (seconds, output tokens, decode-only step times, their host work). A fresh seed each
    pass: no prefix-cache hits between passes."""
    import random

    import torch

    from conveyor.serving.request import SamplingParams

    rng = random.Random(seed)
    for i in range(num_prompts):
        ids = [rng.randrange(3, SMOLLM2_SHAPES["vocab_size"]) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(engine.make_request(ids, params, f"s{seed}-{i}"))
    decode_steps, host, tokens = [], [], 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        outputs, stats = engine.step()
        tokens += len(outputs)
        if stats.num_prefill_tokens == 0:
            decode_steps.append(stats.step_time_s)
            host.append(stats.timings.host_s)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, tokens, decode_steps, host


def engine_run(model_dir: pathlib.Path, graphs: bool, num_prompts: int, prompt_len: int, out_len: int,
               async_scheduling: bool = False) -> dict:
    """Offline throughput of one engine (bf16, auto backend): a warm-up pass of the same shapes (Triton
    compiles, cuBLAS plans), then num_prompts prompts of prompt_len random ids x out_len greedy tokens."""
    import gc

    import torch

    from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from conveyor.serving.engine import LLMEngine

    gc.collect()  # engines of earlier checks (tests) must not count against this one's memory
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model_dir), device="cuda"),  # SmolLM2's own context: 8192
        cache=CacheConfig(gpu_memory_utilization=0.5),
        scheduler=SchedulerConfig(max_num_seqs=num_prompts, max_num_batched_tokens=2048,
                                  async_scheduling=async_scheduling),
        enable_cuda_graphs=graphs))
    init_s = time.perf_counter() - start
    _engine_pass(engine, 1, num_prompts, prompt_len, 8)
    graphs_obj = engine.runner.decode_graphs
    replays_before = graphs_obj.num_replays if graphs_obj is not None else 0
    seconds, tokens, decode_steps, host = _engine_pass(engine, 2, num_prompts, prompt_len, out_len)
    decode_steps.sort()
    host.sort()
    result = {
        "cuda_graphs": graphs_obj is not None, "async_scheduling": async_scheduling,
        "backend": engine.attention_backend, "dtype": str(engine.dtype),
        "init_s": round(init_s, 2), "kv_blocks": engine.kv_cache.num_blocks,
        "capture_s": round(graphs_obj.capture_seconds, 2) if graphs_obj is not None else None,
        "captured_sizes": graphs_obj.sizes if graphs_obj is not None else None,
        "graph_steps": (graphs_obj.num_replays - replays_before) if graphs_obj is not None else 0,
        "seconds": round(seconds, 3), "output_tokens": tokens, "output_tok_per_s": round(tokens / seconds, 1),
        "decode_steps": len(decode_steps),
        "decode_step_ms_p50": round(1e3 * decode_steps[len(decode_steps) // 2], 3) if decode_steps else None,
        # host work of a decode step (schedule, inputs, sampling, update): graph replays fold inputs into forward
        "decode_host_ms_p50": round(1e3 * host[len(host) // 2], 3) if host else None,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    del engine, graphs_obj
    gc.collect()
    torch.cuda.empty_cache()
    return result


def engine_benchmark(enabled: bool, num_prompts: int = 64, prompt_len: int = 128, out_len: int = 128) -> dict:
    """SmolLM2-shaped engine throughput (random bf16 weights), CUDA graphs on and off, decode-heavy workload."""
    if not enabled:
        return {"skipped": "pass --engine to run"}
    import tempfile

    report: dict = {"workload": {"num_prompts": num_prompts, "prompt_len": prompt_len, "out_len": out_len}}
    try:
        start = time.monotonic()
        model_dir = build_smollm2_shaped(pathlib.Path(tempfile.mkdtemp(prefix="smollm2-shaped-")))
        report["model_build_s"] = round(time.monotonic() - start, 1)
        for label, graphs, ahead in (("graphs_on", True, False), ("graphs_off", False, False),
                                     ("graphs_on_async", True, True)):
            if _time_left() < 45:
                report[label] = {"skipped": "out of time"}
                continue
            report[label] = engine_run(model_dir, graphs, num_prompts, prompt_len, out_len, ahead)
            print(f"engine {label}:", report[label], flush=True)
    except Exception as exc:  # noqa: BLE001 - report the failure and keep the rest of the check
        import traceback

        report["error"] = traceback.format_exc()[-3000:]
        print("engine benchmark failed:", exc, flush=True)
    on, off = report.get("graphs_on", {}), report.get("graphs_off", {})
    if "output_tok_per_s" in on and "output_tok_per_s" in off:
        report["graphs_speedup"] = round(on["output_tok_per_s"] / off["output_tok_per_s"], 2)
    ahead = report.get("graphs_on_async", {})
    if "output_tok_per_s" in on and "output_tok_per_s" in ahead:
        report["async_speedup"] = round(ahead["output_tok_per_s"] / on["output_tok_per_s"], 2)
    return report


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
    report["engine"] = engine_benchmark(args.engine)  # before the decode table, which fills the time left
    report["decode"] = time_decode(torch, copy_bps, args.quick)
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
