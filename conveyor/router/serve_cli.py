"""`conveyor serve`: an embedded local Ray, the Conveyor application on host:port, in the foreground.

Settings come from, in rising precedence: ServeArgs defaults, `--config FILE` (a mapping of ServeArgs, or a
whole Serve config such as deploy/serve.yaml, whose first application's args are used), $CONVEYOR_API_KEY,
then the flags given on the command line. The API key is best given by $CONVEYOR_API_KEY or `--api-key-file`:
`--api-key` shows in the process list to every user of the host.

The local Ray cluster keeps Ray's token authentication (RAY_AUTH_MODE=token unless the environment says
otherwise; Ray creates ~/.ray/auth_token the first time). Ray 2.60's GCS, raylet and workers listen on every
interface whatever address the node is given, so without a token anyone who reaches this host's Ray ports could
run code in it: RAY_AUTH_MODE=disabled is honoured, with a warning, for hosts a firewall closes.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor import envs
from conveyor.router.api_key import API_KEY_ENV, read_api_key_file
from conveyor.router.worker_setup import NO_PROXY_ENV

if TYPE_CHECKING:
    from conveyor.router.app import ServeArgs

logger = logging.getLogger("conveyor.serve")
logger.setLevel(logging.INFO)  # where we listen is always worth a line, even without -v

APP_NAME = "conveyor"
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
SERVE_ONLY_FLAGS = ("host", "port", "config", "command", "func", "verbose", "serve_parser", "http_proxy",
                    "engine_keys", "print_config")
CLUSTER_POLL_S = 2.0  # how often the foreground process checks that its local Ray cluster still runs
# After a SIGTERM, how long Ray's own processes get to show that it reached them too (see _Stopped).
SIGTERM_GRACE_S = 1.0


def serve_env(port: int, http_proxy: bool) -> dict[str, str]:
    """Ray Serve settings for the local cluster (its processes read them when they import Serve).

    By default the ingress replica listens on `port` itself ("direct ingress"): no Serve HTTP proxy process
    re-sends every SSE chunk through a Ray call, user code runs on the replica's own event loop, and handles
    talk gRPC. At saturation the proxy and the thread hops are most of the path's CPU per streamed token
    (figures: benchmarks/RESULTS.md, "Defaults and the measurements behind them"). `--http-proxy` keeps Serve's
    proxy (several apps under one port).
    A value already in the environment wins.
    """
    quiet = ray_background_env()
    if http_proxy:
        return quiet
    return quiet | {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
            # The one ingress replica gets exactly the port asked for (Serve allocates from this range).
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # exclusive
            # Direct ingress holds a stopping ingress open this long for load balancers to deregister it;
            # one local process has none, and Ctrl-C should not wait 30 s.
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
            # The controller's loop at 10 Hz costs ~4.5% of a core while idle (measured); at 2 Hz ~2%. Scaling
            # decisions and deploy transitions come up to 0.4 s later, against policy delays of seconds.
            "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
            # Serve would still start an HTTP proxy that no request passes through (worker_setup.py).
            NO_PROXY_ENV: "1"}


def cluster_runtime_env(env: dict[str, str]) -> dict[str, object]:
    """The runtime env of every process of the local cluster: Serve's settings, and a setup hook (worker_setup.py)
    that makes every Serve process (the HTTP proxy of --http-proxy included) ignore the client headers that would
    switch off its request timeout or disconnect handling, and keeps the controller from starting an unused proxy
    under direct ingress."""
    from conveyor.router.worker_setup import SETUP_HOOK

    return {"env_vars": env, "worker_process_setup_hook": SETUP_HOOK}


def ray_background_env() -> dict[str, str]:
    """Slower reports from Ray's own bookkeeping, which a local server only needs for `ray` CLI views: an idle
    `conveyor serve` then takes less CPU. On a small CPU machine each CPU-second elsewhere costs the engine's
    OpenMP team about two: the partner thread waits at the next barrier. Ray's own metrics
    (ray_* series, not the conveyor_* ones, which replicas serve themselves) export every 60 s instead of 10;
    task events (`ray list tasks`) every 10 s instead of 1; Serve's cached metrics every 1 s instead of 0.1; no
    event-loop statistics in Ray's C++ components. The dashboard agent samples every Ray process's CPU and memory
    for those ray_* series every 60 s instead of 5, and checks that its raylet lives every 2 s instead of 0.4 (it
    gives the raylet 5 s); no idle worker is started ahead of need, for the driver or later (a replica's start
    measures the same without it). Idle figures: benchmarks/RESULTS.md, "Defaults and the measurements behind them"."""
    return {"RAY_metrics_report_interval_ms": "60000", "RAY_task_events_report_interval_ms": "10000",
            "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000", "RAY_event_stats": "0",
            "REPORTER_UPDATE_INTERVAL_MS": "60000", "RAY_DASHBOARD_AGENT_CHECK_PARENT_INTERVAL_S": "2",
            "RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--config", type=Path, default=None, help="YAML file: ServeArgs or a Serve config")
    parser.add_argument("--num-replicas", type=int, default=1)
    parser.add_argument("--num-cpus", type=float, default=None,
                        help="CPUs per engine replica (Ray gives it as many torch threads); default: every core "
                             "of this machine for a single CPU replica, else 1")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per engine replica")
    parser.add_argument("--no-engine-process", dest="engine_process", action="store_false",
                        help="step the engine on a thread of the replica process instead of a child process")
    parser.add_argument("--engine-in-ingress", action=argparse.BooleanOptionalAction, default=None,
                        help="run the engine client inside the ingress process, one Ray worker fewer on every "
                        "token's path (default: on for one fixed replica; --no-engine-in-ingress gives the engine a "
                        "Serve replica of its own)")
    parser.add_argument("--http-proxy", action="store_true",
                        help="put Ray Serve's HTTP proxy in front of the ingress (default: the ingress listens on "
                             "--port itself, one hop less per streamed token)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    # The default repeats ServeArgs' (this module must not import Ray); tests/router/test_config_sources.py holds
    # every serve flag's default equal to ServeArgs'.
    parser.add_argument("--request-timeout-s", type=_seconds_or_none, default=1800.0,
                        help="end a request (queue + generation) after this many seconds: a 408, or an SSE error "
                             "event mid-stream, and its engine work aborted ('none': no deadline)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $CONVEYOR_API_KEY); visible in the "
                             "process list: prefer $CONVEYOR_API_KEY or --api-key-file")
    parser.add_argument("--api-key-file", default=None,
                        help="read the API key from this file (each ingress reads it at its start)")
    parser.add_argument("--print-config", nargs="?", const="yaml", choices=("yaml", "json"), default=None,
                        help="print the effective settings (defaults, --config, $CONVEYOR_API_KEY and flags merged) "
                             "as YAML or JSON and exit, without starting Ray")


def _seconds_or_none(text: str) -> float | None:
    if text.strip().lower() in ("none", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or 'none', got {text!r}") from None


def load_config_file(path: Path) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    if "applications" in data:  # a full Serve config (deploy/serve.yaml): take the first app's args
        return dict(data["applications"][0].get("args") or {})
    return dict(data)


def serve_args_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Merge config file and flags. A flag overrides the file only when it differs from its default."""
    merged = load_config_file(args.config) if args.config else {}
    if envs.is_set(API_KEY_ENV):
        merged["api_key"] = envs.get(API_KEY_ENV)
    for dest, value in vars(args).items():
        if dest in SERVE_ONLY_FLAGS or value == parser.get_default(dest):
            continue
        merged[dest] = value  # flag dests are ServeArgs field names
    return merged


def ray_auth_mode() -> str:
    """Ray's token authentication for the local cluster: on unless RAY_AUTH_MODE says otherwise (set before Ray
    is imported; the raylet and every worker inherit it)."""
    mode = os.environ.setdefault(RAY_AUTH_MODE_ENV, "token").lower()
    if mode != "token":
        logger.warning("%s=%s: Ray's token authentication is off, and Ray listens on every interface of this host; "
                       "anyone who can reach its ports can run code here. Use it only behind a firewall.",
                       RAY_AUTH_MODE_ENV, mode)
    return mode


def check_api_key_settings(cfg: ServeArgs) -> None:
    """Fail before Ray starts on an API key file the ingress could not read; warn about a key in argv."""
    if cfg.api_key_file and not cfg.api_key:
        read_api_key_file(cfg.api_key_file)
    if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in sys.argv):
        logger.warning("--api-key is visible in the process list: prefer $%s or --api-key-file", API_KEY_ENV)


def effective_serve_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[ServeArgs, bool]:
    """ServeArgs after defaults, the config file, the environment and the flags; and whether num_cpus was given.
    ValueError (a pydantic ValidationError) on bad settings, before Ray starts."""
    from conveyor.router.app import ServeArgs

    settings = serve_args_from(args, parser)
    cfg = ServeArgs.model_validate(settings)
    if "num_cpus" not in settings and _single_cpu_replica(cfg):
        # Ray sets a replica's OMP_NUM_THREADS to its num_cpus: the default 1 would leave the other cores idle.
        cfg = cfg.model_copy(update={"num_cpus": float(os.cpu_count() or 1)})
    if "engine_in_ingress" not in settings and cfg.fixed_single_replica():
        cfg = cfg.model_copy(update={"engine_in_ingress": True})
    return cfg, "num_cpus" in settings


def print_config(cfg: ServeArgs, fmt: str) -> str:
    """The settings as `fmt` (yaml or json), in the keys a --config file takes; the API key itself is masked."""
    import json

    import yaml

    data = cfg.model_dump(mode="json")
    if data.get("api_key"):
        data["api_key"] = "***"
    if fmt == "json":
        return json.dumps(data, indent=2)
    return yaml.safe_dump(data, sort_keys=False)


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.print_config:
        try:
            cfg, _ = effective_serve_args(args, parser)
        except ValueError as exc:
            parser.error(str(exc))
        print(print_config(cfg, args.print_config))
        return 0
    auth_mode = ray_auth_mode()
    env: dict[str, str] = {}
    for key, value in serve_env(args.port, args.http_proxy).items():
        env[key] = os.environ.setdefault(key, value)
    import ray
    from ray import serve

    from conveyor.router.app import build_app
    from conveyor.serving.openmp_runtime import engine_child_env
    from conveyor.serving.priority import ray_batch_setting, run_children_as_batch

    cfg, _ = effective_serve_args(args, parser)  # fail on bad settings before Ray starts
    try:  # bad engine settings in the environment fail here, as the replica would read them
        check_api_key_settings(cfg)
        engine_child_env(os.environ)
        ray_as_batch = ray_batch_setting()
    except ValueError as exc:
        parser.error(str(exc))
    started = time.monotonic()
    # Logical CPUs: let the requested replicas fit even where they oversubscribe a small machine.
    num_cpus = max(os.cpu_count() or 1, int(cfg.num_cpus * cfg.num_replicas + 1))
    if ray_as_batch and cfg.engine_process:  # an engine on a replica thread would run batch too
        run_children_as_batch()  # Ray's processes inherit it; the engine process leaves it (serving/priority.py)
    context = ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=args.verbose,
                       runtime_env=cluster_runtime_env(env))
    logger.info("Ray cluster at %s, authentication %s", context.address_info.get("gcs_address"), auth_mode)
    if not args.verbose:
        _stop_log_monitor()
    # SIGTERM (docker stop, kill) takes the same clean path as Ctrl-C, also while the model is loading. SIGINT
    # gets the handler explicitly: a shell starts a background job (`conveyor serve &`) with SIGINT ignored,
    # and Python then leaves it ignored, so `kill -INT` did nothing.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _interrupt)
    grace_s = 0.0
    try:
        # With direct ingress the ingress replica listens on --port (serve_env) and the controller starts no
        # proxy (worker_setup.py); the proxy's options still get a spare port, should a patch not take.
        proxy_port = args.port if args.http_proxy else _free_port(args.host)
        serve.start(http_options={"host": args.host, "port": proxy_port})
        logger.info("deploying %s (%d replica(s), %s CPU / %s GPU each)...", cfg.model, cfg.num_replicas,
                    cfg.num_cpus, cfg.num_gpus)
        serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")
        logger.info("Conveyor is serving %r at http://%s:%d (OpenAI API under /v1), ready in %.1fs; "
                    "Ctrl-C to stop", cfg.served_model_name or cfg.model, args.host, args.port,
                    time.monotonic() - started)
        lost = _wait_while_cluster_runs()
        logger.error("the Ray cluster lost its %s (`ray stop`, or a crash); exiting", ", ".join(lost))
        return 1
    except KeyboardInterrupt as stop:
        logger.info("shutting down")
        if isinstance(stop, _Stopped) and stop.signum == signal.SIGTERM:
            grace_s = SIGTERM_GRACE_S
        return 0
    finally:
        if not _lost_cluster_processes(grace_s):  # serve.shutdown() would wait on a dead controller
            serve.shutdown()
        ray.shutdown()


def _single_cpu_replica(cfg: ServeArgs) -> bool:
    return cfg.fixed_single_replica() and cfg.num_gpus == 0 and cfg.device in ("auto", "cpu")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop_log_monitor() -> None:
    """Ray's log monitor exists to stream the workers' output to the driver, which `log_to_driver=False` turns
    off, yet it still polls the log directory ten times a second: the largest of Ray's system processes on an
    idle server, more than the GCS and the raylet together. `ray.init` cannot leave it out (`ray start
    --include-log-monitor=false` can), so it is stopped once started; the logs stay in /tmp/ray/session_*/logs."""
    try:
        _local_node().kill_log_monitor(check_alive=False)
    except Exception as exc:  # noqa: BLE001 - an internal API: where it moved, the monitor keeps running
        logger.debug("Ray's log monitor left running: %r", exc)


def _wait_while_cluster_runs() -> list[str]:
    """Wait (for Ctrl-C or SIGTERM) while the local Ray cluster that ray.init started keeps all its processes;
    return the names of those that died. Without this check a `ray stop` from another shell left this process
    waiting forever, its Ray client threads retrying the lost GCS on a whole core (half of a 2-core machine,
    measured)."""
    while not (lost := _lost_cluster_processes()):
        time.sleep(CLUSTER_POLL_S)
    return lost


def _lost_cluster_processes(grace_s: float = 0.0) -> list[str]:
    """The process types (gcs_server, raylet, ...) of the local cluster that have died, waiting up to grace_s for
    one to; empty while it runs, or where this process joined a cluster it did not start."""
    node = _local_node()  # where the internal API moved (None), only signals stop us
    if node is None:
        return []
    deadline = time.monotonic() + grace_s
    while not (lost := sorted({process_type for process_type, _ in node.dead_processes()})) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    return lost


def _local_node():  # noqa: ANN202 - ray._private.node.Node, an internal type
    """The Ray node this process started with ray.init (its GCS, raylet, ... as child processes), or None."""
    from ray._private import worker as ray_worker

    return getattr(ray_worker, "_global_node", None)


class _Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM, taken as Ctrl-C. A SIGTERM may have gone to the whole process group (systemd's default
    KillMode=control-group, `timeout`), Ray's own processes included, which block only SIGINT: they die of it, and
    serve.shutdown() through them waited 30-60 s for a controller already gone. So after a SIGTERM the shutdown first
    gives them SIGTERM_GRACE_S to show it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, _frame: object) -> None:
    # The shutdown runs once: make passes its SIGTERM on to its child, so `make serve` got a second one mid-shutdown,
    # which escaped the `finally` and left Ray's exception hook waiting on the GCS.
    for other in (signal.SIGTERM, signal.SIGINT):
        signal.signal(other, signal.SIG_IGN)
    raise _Stopped(signum)
