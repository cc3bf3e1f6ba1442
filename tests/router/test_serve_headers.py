"""The client headers that would switch off Serve's request timeout or disconnect handling are ignored in Serve's
HTTP proxy actor too (`conveyor serve --http-proxy`), through the Ray worker setup hook that `conveyor serve` gives
every process of its cluster (conveyor/router/serve_headers.py). The proxy actor is a Ray worker that runs none of
our code otherwise: what decides is which parsers its module binds, checked here without starting Ray."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from conveyor.router import serve_headers, worker_setup
from conveyor.router.serve_cli import cluster_runtime_env

HOSTILE = {b"x-request-timeout-seconds": b"0", b"x-request-disconnect-disabled": b"?1"}
ROOT = Path(__file__).resolve().parents[2]


def test_the_hook_makes_serve_s_proxy_module_ignore_the_headers_in_a_fresh_worker() -> None:
    """As in a new Ray worker: the hook runs first, then the worker imports Serve's proxy module for the actor."""
    script = textwrap.dedent(f"""
        from conveyor.router.serve_headers import ignore_client_overrides_everywhere
        ignore_client_overrides_everywhere()
        from ray.serve._private import proxy, replica
        headers = {HOSTILE!r}
        for module in (proxy, replica):
            assert module.parse_request_timeout_header(headers, 30.0) == 30.0, module.__name__
            assert module.parse_request_timeout_header(headers, None) is None, module.__name__
            assert module.parse_disconnect_disabled_header(headers) is False, module.__name__
        print("ignored")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ignored"]


def test_the_hook_also_replaces_parsers_a_module_bound_before_it_ran(monkeypatch) -> None:
    from ray.serve._private import http_util, proxy, replica

    # What a client gets from Serve's own parsers: its timeout off, its disconnect watch off.
    assert proxy.parse_request_timeout_header(HOSTILE, 30.0) is None
    assert proxy.parse_disconnect_disabled_header(HOSTILE) is True
    modules = (http_util, proxy, replica)
    for module in modules:  # restored after the test: other tests in this process read Serve's own parsers
        for name in serve_headers.PARSER_NAMES:
            monkeypatch.setattr(module, name, getattr(module, name))
    serve_headers.ignore_client_overrides_everywhere()
    for module in modules:
        assert module.parse_request_timeout_header(HOSTILE, 30.0) == 30.0
        assert module.parse_disconnect_disabled_header(HOSTILE) is False
    # A header the server itself would honour changes nothing either: the server's setting is the only one.
    assert proxy.parse_request_timeout_header({b"x-request-timeout-seconds": b"5"}, 30.0) == 30.0


def test_conveyor_serve_gives_every_cluster_process_the_hook() -> None:
    from ray._common.utils import load_class

    runtime_env = cluster_runtime_env({"A": "b"})
    assert runtime_env["env_vars"] == {"A": "b"}
    assert load_class(runtime_env["worker_process_setup_hook"]) is worker_setup.setup_worker


def test_the_setup_hook_switches_the_headers_off(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(worker_setup, "ignore_client_overrides_everywhere", lambda: calls.append(1))
    monkeypatch.delenv(worker_setup.NO_PROXY_ENV, raising=False)
    worker_setup.setup_worker()
    assert calls == [1]
