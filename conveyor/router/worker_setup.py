"""What every Ray worker of the cluster that `conveyor serve` starts runs first (Ray's worker_process_setup_hook).

- Serve's client-header overrides are switched off (serve_headers.py).
- Under direct ingress (`conveyor serve`'s default), the Serve controller starts no HTTP proxy actor. Ray Serve
  2.60 starts one on the head node whatever proxy_location says once direct ingress is on
  (ray/serve/_private/controller.py), yet the ingress replica listens on --port itself and no request passes
  through the proxy: it idles at ~0.014 cores (a Ray worker's main thread checks for signals 100 times a second,
  under the GIL), 0.7% of a 2-core machine that the engine's OpenMP team would use. The controller's proxy
  manager is therefore given no node to place a proxy on (ProxyLocation.Disabled would also stop the ingress
  replica's own HTTP server); Serve's fallback proxy exists only for HAProxy, which we do not run. serve_cli.py
  sets CONVEYOR_SERVE_NO_PROXY=1 for the cluster unless the environment says 0; `--http-proxy` leaves it unset
  and keeps the proxy (it is then the way in).
"""
from __future__ import annotations

import logging

from conveyor import envs
from conveyor.router.serve_headers import ignore_client_overrides_everywhere

logger = logging.getLogger("ray.serve")

NO_PROXY_ENV = envs.SERVE_NO_PROXY
SETUP_HOOK = f"{__name__}.setup_worker"


def setup_worker() -> None:
    """Never raises: a failing setup hook stops its worker."""
    ignore_client_overrides_everywhere()
    # Only where set: a cluster `conveyor serve --http-proxy` started runs this hook too, and needs its proxy.
    if envs.is_set(NO_PROXY_ENV) and envs.get(NO_PROXY_ENV) == "1":
        leave_out_proxy()


def leave_out_proxy() -> bool:
    """Make this process's Serve proxy manager (the controller's) place its proxies on no node; False where Serve
    moved it. The proxy location itself stays as Serve set it: the ingress replica reads it, and starts its own
    HTTP server only where it is not Disabled."""
    try:
        from ray.serve._private import proxy_state
    except Exception:  # noqa: BLE001 - no Serve in this worker's environment: no controller here
        return False
    manager = proxy_state.ProxyStateManager
    target_nodes = getattr(manager, "_get_target_nodes", None)
    if target_nodes is None:
        logger.warning("Serve's proxy manager moved in this version: its idle proxy stays")
        return False
    if getattr(target_nodes, "_conveyor_no_proxy", False):
        return True

    def no_target_nodes(self, proxy_nodes) -> list:  # noqa: ANN001 - Serve's signature
        return []

    no_target_nodes._conveyor_no_proxy = True
    manager._get_target_nodes = no_target_nodes
    return True
