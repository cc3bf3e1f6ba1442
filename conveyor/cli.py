"""The `conveyor` command line: one entry point, subcommands."""
from __future__ import annotations

import argparse
import logging
import sys


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    from conveyor.serving.config import ADMISSION_POLICIES, KV_CACHE_DTYPES  # dataclasses only: no torch, no ray

    parser.add_argument("--model", default="smollm2", help="'smollm2', a local HF dir, or a .gguf file")
    parser.add_argument("--scheduling", choices=["continuous", "static"], default="continuous")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-bytes", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                        help="the KV cache's dtype (auto: the model's); bfloat16 on a float32 CPU model holds "
                             "twice the tokens in the same memory")
    parser.add_argument("--memory-fraction", type=float, default=0.25)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--itl-slo-ms", type=float, default=None,
                        help="tail-latency mode: size each step to keep inter-token latency under this target")
    parser.add_argument("--tpot-slo-ms", type=_optional_ms, default=100.0,
                        help="while requests decode, size each step to keep the mean time per output token under "
                             "this target ('none': the fixed --max-num-batched-tokens budget)")
    parser.add_argument("--ttft-slo-ms", type=_optional_ms, default=2000.0,
                        help="with --admission-policy slo, refuse (429) a request whose predicted time to first "
                             "token exceeds this ('none': no TTFT admission)")
    parser.add_argument("--admission-policy", choices=list(ADMISSION_POLICIES), default="slo",
                        help="slo: refuse what would miss --ttft-slo-ms, so admitted requests keep their SLO; "
                             "queue: every request waits its turn up to the queue bounds")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="schedule each step while the one before runs (vLLM's option; off by default)")
    parser.add_argument("--gguf-max-rows", type=int, default=None,
                        help="CPU, model from a GGUF: steps of at most this many tokens read its quantized blocks "
                             "(0: always the fp32 weights; default: 64 with AVX-512 or AVX2, else 8)")
    parser.add_argument("--no-cpu-decode-stack", dest="cpu_decode_stack", action="store_false",
                        help="CPU, model from a GGUF: run decode steps layer by layer from Python rather than in "
                             "one C++ call (for comparison; the outputs are the same)")


def _optional_ms(text: str) -> float | None:
    """A latency target in ms, or 'none' to switch it off."""
    if text.strip().lower() in ("none", "off"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or 'none', got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of milliseconds, got {text!r}")
    return value


def engine_config_from_args(args: argparse.Namespace):  # noqa: ANN201 - EngineConfig, imported lazily
    from conveyor.serving.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device,
                          max_model_len=args.max_model_len),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks,
                          kv_cache_bytes=args.kv_cache_bytes, memory_fraction=args.memory_fraction,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, scheduling=args.scheduling,
                                  itl_slo_ms=args.itl_slo_ms, tpot_slo_ms=args.tpot_slo_ms,
                                  ttft_slo_ms=args.ttft_slo_ms, admission_policy=args.admission_policy,
                                  async_scheduling=args.async_scheduling),
        attention_backend=args.attention_backend, gguf_max_rows=args.gguf_max_rows,
        cpu_decode_stack=args.cpu_decode_stack)


def cmd_generate(args: argparse.Namespace) -> int:
    from conveyor.serving.engine import LLMEngine
    from conveyor.serving.request import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    messages = [{"role": "user", "content": args.prompt}]
    prompt = args.prompt if args.raw else engine.apply_chat_template(messages)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    engine.add_request(engine.make_request(prompt, params))
    while engine.has_unfinished():
        outputs, _ = engine.step()
        for out in outputs:
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_model_pull(args: argparse.Namespace) -> int:
    from conveyor.serving.models.loader import pull_model

    print(pull_model(args.name))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from conveyor.router.serve_cli import run_serve

    return run_serve(args, args.serve_parser)


def cmd_bench(argv: list[str]) -> int:
    from conveyor.bench.runner import main as bench_main  # imports neither ray nor torch

    return bench_main(argv)


def cmd_dashboards_push(args: argparse.Namespace) -> int:
    from conveyor.dashboards import push

    for result in push(args.url, args.api_key, args.folder):
        print(f"{result.get('status', 'ok')}: {result.get('url', result.get('uid', ''))}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description="Conveyor LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="more logging; under `serve`, Ray's workers' output too (else it stays in "
                             "/tmp/ray/session_*/logs)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a streamed answer to one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API on a local Ray (foreground)")
    _add_engine_args(srv)
    from conveyor.router.serve_cli import add_serve_args  # imports neither ray nor torch

    add_serve_args(srv)
    srv.set_defaults(func=cmd_serve, serve_parser=srv)

    model = sub.add_parser("model", help="manage models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    pull = model_sub.add_parser("pull", help="download and convert a model into the local cache")
    pull.add_argument("name", nargs="?", default="smollm2")
    pull.set_defaults(func=cmd_model_pull)

    # `bench` parses its own arguments (main() hands them over before this parser sees them); listed here
    # so `conveyor --help` shows it.
    sub.add_parser("bench", help="serving benchmark of any OpenAI-compatible server over HTTP; "
                   "`conveyor bench compare` for side by side", add_help=False)

    dash = sub.add_parser("dashboards", help="Grafana dashboards")
    dash_sub = dash.add_subparsers(dest="dashboards_command", required=True)
    push = dash_sub.add_parser("push", help="create or overwrite the dashboards in a Grafana")
    push.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    push.add_argument("--api-key", required=True, help="a Grafana API key or service account token")
    push.add_argument("--folder", default=None, help="folder title (created if missing); default: General")
    push.set_defaults(func=cmd_dashboards_push)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
