"""Helpers for the tests that deploy to Ray Serve; `serve_cluster` (tests/conftest.py) is one Ray cluster and one
Serve HTTP proxy for the whole session.

Each test module deploys its own application under its own route prefix with `deploy(...)` and deletes it
afterwards. Every wait has its own deadline, so a deployment that cannot be placed fails instead of hanging.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before ray is imported: token auth is on by default

import ray  # noqa: E402
from ray import serve  # noqa: E402

DEPLOY_TIMEOUT_S = 120.0


def _free_port() -> int:
    # Other engineers' test runs share this host: never assume 8000 is ours.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _running_serve_port() -> int | None:
    if not ray.is_initialized():
        return None
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return client.http_config.port if client is not None else None


@contextmanager
def attached_or_new_serve() -> Iterator[str]:
    """Yield the base URL of the Serve proxy: the running one if there is one (left alone afterwards), else a
    new Ray + Serve on a free port, shut down on exit."""
    port = _running_serve_port()
    if port is not None:
        yield f"http://127.0.0.1:{port}"
        return
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()


def wait_until(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@contextmanager
def deploy(args: dict[str, Any], name: str, route_prefix: str,
           timeout_s: float = DEPLOY_TIMEOUT_S, wait: bool = True,
           while_waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Deploy build_app(args) as application `name` at `route_prefix`; delete it on exit.

    wait=False: return once the ingress exists (for apps whose engine never comes up); the delete then does
    not block either, since Serve waits ~20 s on a replica that was never placed. `while_waiting` is called
    at every poll until the application runs (to watch what a client sees meanwhile).
    """
    from ray.serve.api import _run  # serve.run without blocking, so the wait below has a deadline

    from conveyor.router.app import build_app

    _run(build_app(args), name=name, route_prefix=route_prefix, _blocking=False)
    try:
        if wait:
            def running() -> bool:
                if while_waiting is not None:
                    while_waiting()
                return _app_status(name) == "RUNNING"

            wait_until(running, timeout_s, f"application {name} to run", interval_s=0.25)
        yield
    finally:
        serve.delete(name, _blocking=wait)


def _app_status(name: str) -> str | None:
    app = serve.status().applications.get(name)
    if app is not None and app.status in ("DEPLOY_FAILED", "UNHEALTHY"):
        raise RuntimeError(f"application {name} failed: {app.message}")
    return app.status if app is not None else None


def engine_handle(app_name: str) -> Any:
    return serve.get_deployment_handle("EngineReplica", app_name=app_name)


def engine_state(app_name: str, timeout_s: float = 10.0) -> dict[str, int]:
    return engine_handle(app_name).engine_state.remote().result(timeout_s=timeout_s)
