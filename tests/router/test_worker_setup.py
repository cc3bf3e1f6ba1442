"""The Ray worker setup hook that `conveyor serve` gives its cluster (conveyor/router/worker_setup.py) keeps the
Serve controller from placing its HTTP proxy under direct ingress, and leaves it where CONVEYOR_SERVE_NO_PROXY is
unset (`--http-proxy`). Checked as in a fresh worker, without starting Ray: the hook runs, then the controller's
proxy manager chooses the nodes for its proxies. (tests/router/test_cli_serve.py checks a real server.)"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conveyor.router import worker_setup

ROOT = Path(__file__).resolve().parents[2]

# A head-only proxy manager over a one-node cluster, as the controller builds it under direct ingress.
PLACE_PROXIES = textwrap.dedent("""
    from conveyor.router.worker_setup import setup_worker
    setup_worker()
    from ray.serve._private.proxy_state import ProxyStateManager
    from ray.serve.config import HTTPOptions, ProxyLocation
    from ray.serve.schema import LoggingConfig

    class OneNode:
        def get_alive_nodes(self):
            return [("head", "127.0.0.1", "instance")]

    manager = ProxyStateManager(http_options=HTTPOptions(), head_node_id="head", cluster_node_info_cache=OneNode(),
                                logging_config=LoggingConfig(), proxy_location=ProxyLocation.HeadOnly)
    print(manager._get_target_nodes({"head"}), manager.get_proxy_location().value)
""")


def _place_proxies(no_proxy: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != worker_setup.NO_PROXY_ENV}
    if no_proxy is not None:
        env[worker_setup.NO_PROXY_ENV] = no_proxy
    result = subprocess.run([sys.executable, "-c", PLACE_PROXIES], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


@pytest.mark.parametrize(("no_proxy", "placed"), [("1", "[]"), (None, "[('head', '127.0.0.1', 'instance')]"),
                                                  ("0", "[('head', '127.0.0.1', 'instance')]")])
def test_the_hook_places_serve_s_proxy_on_no_node_only_when_asked(no_proxy: str | None, placed: str) -> None:
    # The proxy location the ingress replica reads stays HeadOnly: under Disabled it would not open its port.
    assert _place_proxies(no_proxy) == f"{placed} HeadOnly"


def test_conveyor_serve_asks_for_no_proxy_under_direct_ingress_only() -> None:
    from conveyor.router.serve_cli import serve_env

    assert serve_env(8000, http_proxy=False)[worker_setup.NO_PROXY_ENV] == "1"
    assert worker_setup.NO_PROXY_ENV not in serve_env(8000, http_proxy=True)
