"""Client headers that would switch off Ray Serve's request timeout or its disconnect handling are ignored.

Ray Serve 2.60 reads two per-request headers (ray/serve/_private/http_util.py), meant for a trusted load balancer:
- `x-request-timeout-seconds`: overrides Serve's request_timeout_s; "0" or a negative value switches it off;
- `x-request-disconnect-disabled: ?1`: Serve stops watching for the client's disconnect, so a client that goes
  away leaves its request generating on the engine.
Any client can send them. Serve parses them before the ingress's code sees the request (in the ingress replica
for direct ingress, in its proxy actor with --http-proxy), so the parsers themselves are replaced in the ingress
replica's process (`conveyor serve` uses direct ingress by default). The proxy actor (--http-proxy only) runs none
of our code: there a client can still switch off Serve's checks, but the ingress's own request_timeout_s
(deadline.py) and Starlette's disconnect watch on every stream still end the request.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("ray.serve")


def _timeout_ignoring_header(headers: Any, default_timeout_s: float | None) -> float | None:
    return default_timeout_s


def _disconnect_never_disabled(headers: Any) -> bool:
    return False


def ignore_client_overrides() -> bool:
    """Make Serve's header parsers in this process return the server's settings; False where Serve moved them."""
    try:
        from ray.serve._private import replica
    except ImportError:
        return False
    if not (hasattr(replica, "parse_request_timeout_header") and hasattr(replica, "parse_disconnect_disabled_header")):
        logger.warning("Serve's per-request timeout/disconnect headers could not be switched off in this version")
        return False
    replica.parse_request_timeout_header = _timeout_ignoring_header
    replica.parse_disconnect_disabled_header = _disconnect_never_disabled
    return True

