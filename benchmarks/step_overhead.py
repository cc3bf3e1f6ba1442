"""Host work per engine step, apart from the model: a one-layer tiny Llama at batch 1, 64 and 256.

Per decode step (median over steps where every running request decodes) it prints the time in scheduling,
input preparation, the forward (logits included), sampling, the core's update (appending tokens, token-level
records), and apart from the core step, output processing (detokenizing, stop strings, RequestOutputs), which
`conveyor serve` runs in the replica process while the engine process computes the next step. "host" is the core
step's host work in the phases it times: everything but the forward. "wall" times the core step from outside, so
"w-fwd" (wall minus the forward) also counts the bookkeeping between the phases that none of them times. "xfer"
is what `conveyor serve` adds between its processes: the step's outputs and stats pickled and unpickled. The
model is so small that the host work shows apart from the model; it is the part of a step that stays the same on
a GPU, where it is what leaves the device idle between steps.

    .venv/bin/python -m benchmarks.step_overhead                       # batch 1, 64, 256; greedy and top-p
    .venv/bin/python -m benchmarks.step_overhead --batch-sizes 64 --json out.json
    .venv/bin/python -m benchmarks.step_overhead --model ~/.cache/conveyor/models/SmolLM2-135M-Instruct

The tiny model's vocabulary has 384 tokens, so its sampling column shows the per-step overhead, not the cost of
sampling over a real vocabulary (SmolLM2: 49 152); --model with a real one shows that.
"""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import tempfile
import time
from pathlib import Path

from conveyor.serving import LLM, SamplingParams

PHASES = ("schedule_s", "prepare_s", "forward_s", "sample_s", "output_s", "process_s")


def measure(model_dir: str, batch_size: int, sampled: bool, num_steps: int, prompt_len: int) -> dict:
    llm = LLM(model_dir, max_num_seqs=batch_size, max_num_batched_tokens=max(512, batch_size * prompt_len),
              num_kv_blocks=batch_size * (-(-(prompt_len + num_steps + 8) // 16)) + 8)
    engine = llm.engine
    params = (SamplingParams(max_tokens=num_steps, temperature=0.8, top_p=0.9, ignore_eos=True) if sampled
              else SamplingParams(max_tokens=num_steps, temperature=0.0, ignore_eos=True))
    for i in range(batch_size):
        prompt = [3 + (i * 7 + j) % 300 for j in range(prompt_len)]
        engine.add_request(engine.make_request(prompt, params))
    steps, walls, transfers = [], [], []
    start = time.perf_counter()
    while engine.has_unfinished():
        step_start = time.perf_counter()
        core_outputs, stats = engine.core_step()
        # The core step's wall time as a caller sees it: the phases plus whatever bookkeeping none of them times.
        wall = time.perf_counter() - step_start
        # What `conveyor serve` adds between its processes: the engine process pickles the step's outputs and
        # stats for the replica, which unpickles them (ProcessEngine; the same pickle as multiprocessing's).
        sent = time.perf_counter()
        pickle.loads(pickle.dumps((core_outputs, stats)))
        transfer_s = time.perf_counter() - sent
        engine.process_outputs(core_outputs, stats)
        if stats.num_prefill_tokens == 0 and stats.batch_size == batch_size:
            steps.append(stats)
            walls.append(wall)
            transfers.append(transfer_s)
    elapsed = time.perf_counter() - start
    steps, walls, transfers = steps[2:], walls[2:], transfers[2:]  # the first decode steps warm allocator caches
    row = {"batch_size": batch_size, "sampling": "top-p" if sampled else "greedy", "num_steps": len(steps),
           "step_ms": 1e3 * statistics.median(s.step_time_s for s in steps),
           "wall_ms": 1e3 * statistics.median(walls),
           "wall_host_ms": 1e3 * statistics.median(w - s.timings.forward_s for w, s in zip(walls, steps, strict=True)),
           "transfer_ms": 1e3 * statistics.median(transfers)}
    for phase in PHASES:
        row[phase.removesuffix("_s") + "_ms"] = 1e3 * statistics.median(getattr(s.timings, phase) for s in steps)
    row["host_ms"] = 1e3 * statistics.median(s.timings.host_s for s in steps)
    row["run_s"] = elapsed
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--num-steps", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--model", default=None, help="model dir; default: a one-layer tiny random Llama")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        from tests.tiny_model import build_tiny_llama

        model_dir = str(build_tiny_llama(Path(tempfile.mkdtemp(prefix="step-overhead-")), num_hidden_layers=1))
    rows = []
    header = f"{'batch':>5} {'sampling':>8} {'step':>7} {'sched':>6} {'prep':>6} {'fwd':>6} {'sample':>6} " \
             f"{'update':>6} {'host':>6} | {'wall':>7} {'w-fwd':>6} | {'detok':>6} {'xfer':>6}  (ms, median per " \
             "decode step; wall: the core step timed by its caller, w-fwd: all of its host work; detok: output " \
             "processing; xfer: the step's outputs pickled and unpickled, as between serve's processes)"
    print(header)
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        for sampled in (False, True):
            r = measure(model_dir, batch_size, sampled, args.num_steps, args.prompt_len)
            rows.append(r)
            print(f"{r['batch_size']:>5} {r['sampling']:>8} {r['step_ms']:7.3f} {r['schedule_ms']:6.3f} "
                  f"{r['prepare_ms']:6.3f} {r['forward_ms']:6.3f} {r['sample_ms']:6.3f} {r['output_ms']:6.3f} "
                  f"{r['host_ms']:6.3f} | {r['wall_ms']:7.3f} {r['wall_host_ms']:6.3f} | {r['process_ms']:6.3f} "
                  f"{r['transfer_ms']:6.3f}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model or "tiny-1-layer", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
