"""Client headers that would switch off Ray Serve's request timeout or its disconnect handling are ignored.

Ray Serve 2.60 reads two per-request headers (ray/serve/_private/http_util.py), meant for a trusted load balancer:
- `x-request-timeout-seconds`: overrides Serve's request_timeout_s; "0" or a negative value switches it off;
- `x-request-disconnect-disabled: ?1`: Serve stops watching for the client's disconnect, so a client that goes
  away leaves its request generating on the engine.
Any client can send them. Serve parses them before the ingress's code sees the request: in the ingress replica
for direct ingress (`conveyor serve`'s default), in its HTTP proxy actor with `--http-proxy` or `serve run`. Both
parsers are therefore replaced with ones that return the server's settings, in two places:
- the ingress replica's process, when the ingress starts (`ignore_client_overrides`): any deployment of the app;
- every process of the cluster that `conveyor serve` starts, the proxy actor included, through Ray's worker setup
  hook (`ignore_client_overrides_everywhere`, set in serve_cli.py): the hook runs before the worker imports
  Serve's proxy or replica module, which then bind the replaced parsers.
An app deployed onto a cluster that `conveyor serve` did not start (`serve run`, a RayService) has no hook: there
the proxy still honours them, and the ingress's own request_timeout_s (deadline.py) and Starlette's disconnect
watch on every stream still end the request.
"""
from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Any

logger = logging.getLogger("ray.serve")

# The modules that bind Serve's parsers (http_util defines them; proxy and replica import them by name).
PARSER_MODULES = ("ray.serve._private.http_util", "ray.serve._private.proxy", "ray.serve._private.replica")
PARSER_NAMES = ("parse_request_timeout_header", "parse_disconnect_disabled_header")
# The worker setup hook's import path (Ray's runtime_env["worker_process_setup_hook"]).
SETUP_HOOK = f"{__name__}.ignore_client_overrides_everywhere"


def _timeout_ignoring_header(headers: Any, default_timeout_s: float | None) -> float | None:
    return default_timeout_s


def _disconnect_never_disabled(headers: Any) -> bool:
    return False


def _replace_parsers(module: ModuleType) -> bool:
    if not all(hasattr(module, name) for name in PARSER_NAMES):
        return False
    module.parse_request_timeout_header = _timeout_ignoring_header
    module.parse_disconnect_disabled_header = _disconnect_never_disabled
    return True


def ignore_client_overrides() -> bool:
    """Make Serve's header parsers in this process's replica module return the server's settings; False where
    Serve moved them."""
    try:
        from ray.serve._private import replica
    except ImportError:
        return False
    if not _replace_parsers(replica):
        logger.warning("Serve's per-request timeout/disconnect headers could not be switched off in this version")
        return False
    return True


def ignore_client_overrides_everywhere() -> None:
    """Ray worker setup hook: the parsers are replaced where Serve defines them and wherever a module has bound
    them already, so Serve's proxy actor ignores the headers too. Never raises: a failing hook stops its worker."""
    try:
        from ray.serve._private import http_util
    except Exception:  # noqa: BLE001 - no Serve in this worker's environment: nothing reads the headers here
        return
    if not _replace_parsers(http_util):
        logger.warning("Serve's per-request timeout/disconnect headers could not be switched off in this version")
        return
    for name in PARSER_MODULES[1:]:
        module = sys.modules.get(name)
        if module is not None:
            _replace_parsers(module)
