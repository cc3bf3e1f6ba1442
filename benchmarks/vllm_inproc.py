"""vLLM's `LLM.generate` on the prompts a `peer_serve.py` run sent, run from vLLM's venv: what vLLM's engine does
in process with its server's defaults, so that `vllm serve`'s throughput has an in-process figure to be divided by,
as `conveyor serve`'s has (peer_serve.py's `vllm_inproc` target starts this with vLLM's recommended CPU set-up).

    .vllm-venv/bin/python benchmarks/vllm_inproc.py --model-dir DIR --prompts prompts.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# `vllm serve`'s defaults on a CPU (vllm/engine/arg_utils.py, UsageContext.OPENAI_API_SERVER), which differ from
# LLM's (4096 tokens, 256 sequences); max_model_len as peer_serve.py starts the server.
SERVER_MAX_NUM_BATCHED_TOKENS = 2048
SERVER_MAX_NUM_SEQS = 128
SERVER_MAX_MODEL_LEN = 2048


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompts", required=True, help="the JSON that vllm_bench_client.py --dump-prompts wrote")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    rows = json.loads(Path(args.prompts).read_text())
    llm = LLM(model=args.model_dir, dtype=args.dtype, max_model_len=SERVER_MAX_MODEL_LEN,
              max_num_seqs=SERVER_MAX_NUM_SEQS, max_num_batched_tokens=SERVER_MAX_NUM_BATCHED_TOKENS, seed=0)
    params = [SamplingParams(max_tokens=r["output_len"], temperature=args.temperature, top_p=args.top_p,
                             ignore_eos=True) for r in rows]
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up, as the servers got one
    started = time.monotonic()
    outputs = llm.generate([r["prompt"] for r in rows], params, use_tqdm=False)
    wall = time.monotonic() - started
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("RESULT " + json.dumps({"completed": len(outputs), "total_output_tokens": num_out, "wall_s": wall}),
          flush=True)


if __name__ == "__main__":
    main()
