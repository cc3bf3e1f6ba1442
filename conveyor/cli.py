"""The `conveyor` command line: one entry point, subcommands."""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any


def _add_engine_args(parser: argparse.ArgumentParser, surface: str = "serve", exclude: tuple[str, ...] = ()) -> None:
    """One flag per flat engine key (conveyor/serving/settings.py): type, choices and help from the engine's
    dataclasses, defaults the surface's (SURFACE_DEFAULTS: `serve` has ServeArgs', `generate` the engine's).
    Booleans take --x / --no-x; an Optional setting also takes `none`."""
    from conveyor.serving.settings import ENGINE_KEYS, surface_defaults  # dataclasses only: no torch, no ray

    defaults = surface_defaults(surface)
    keys = [key for key in ENGINE_KEYS if key not in exclude]
    for key in keys:
        spec = ENGINE_KEYS[key]
        kwargs: dict[str, Any] = {"dest": key, "default": defaults[key], "help": spec.help}
        if spec.base_type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _flag_type(spec.base_type, spec.optional)
            kwargs["metavar"] = key.upper()
            if spec.choices:
                kwargs["choices"] = list(spec.choices)
                kwargs.pop("metavar")
        parser.add_argument(spec.flag, **kwargs)
    parser.set_defaults(engine_keys=tuple(keys))


def _flag_type(base: type, optional: bool) -> Callable[[str], Any]:
    """The flag's text to the setting's type; `none` (or `off`) to None where the setting is Optional."""
    def convert(text: str) -> Any:
        if optional and text.strip().lower() in ("none", "off"):
            return None
        try:
            return base(text)
        except ValueError:
            expected = f"{base.__name__} or 'none'" if optional else base.__name__
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None

    convert.__name__ = base.__name__  # argparse names the type in its errors
    return convert


def engine_config_from_args(args: argparse.Namespace):  # noqa: ANN201 - EngineConfig, imported lazily
    from conveyor.serving.settings import engine_config_from_flat

    return engine_config_from_flat({key: getattr(args, key) for key in args.engine_keys})


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
    # --seed above is the sampling seed; the engine's seed keeps its default.
    _add_engine_args(gen, "generate", exclude=("seed",))
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API on a local Ray (foreground)")
    _add_engine_args(srv, "serve")
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
