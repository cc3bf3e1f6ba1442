"""How every replica's metrics reach Prometheus from every node with one scrape config.

Each Serve replica (engine or ingress) serves its own process' prometheus-client registry on an ephemeral
port bound to its node's IP (`start_http_server(0)`: no port collisions however many replicas share a
host), and registers `ip:port` with labels in one named, detached actor, `MetricsRegistry`. Registrations
are leases, renewed every few seconds by a daemon thread: a replica that dies or is removed simply stops
renewing and drops out of the list within `LEASE_S`, with no dependency on Serve internals.

The ingress serves the live list at `GET /metrics/targets` in Prometheus' HTTP service-discovery format,
so `deploy/prometheus/prometheus.yml` needs one `http_sd_configs` entry pointing at the Serve HTTP port.
The autoscaling policy (inside the ServeController) reports the fleet's current/target replica counts
here too; the ingress turns them into the `conveyor_replicas_*` gauges.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray

logger = logging.getLogger(__name__)

REGISTRY_NAME = "conveyor-metrics-registry"
REGISTRY_NAMESPACE = "conveyor"
LEASE_S = 15.0
RENEW_EVERY_S = 3.0


@ray.remote(num_cpus=0, max_restarts=-1)
class MetricsRegistry:
    """target key -> (address, labels, expiry). Small and in memory: losing it costs one lease period."""

    def __init__(self) -> None:
        self._targets: dict[str, tuple[str, dict[str, str], float]] = {}
        self._fleet: dict[str, dict[str, float]] = {}

    def register(self, key: str, address: str, labels: dict[str, str], lease_s: float = LEASE_S) -> None:
        self._targets[key] = (address, dict(labels), time.monotonic() + lease_s)

    def unregister(self, key: str) -> None:
        self._targets.pop(key, None)

    def targets(self, app: str | None = None) -> list[dict[str, Any]]:
        """Live targets in http_sd format: [{"targets": ["ip:port"], "labels": {...}}]."""
        now = time.monotonic()
        for key in [k for k, (_, _, expiry) in self._targets.items() if expiry < now]:
            del self._targets[key]
        return [{"targets": [address], "labels": labels}
                for address, labels, _ in sorted(self._targets.values())
                if app is None or labels.get("conveyor_app") == app]

    def report_fleet(self, app: str, current: int, target: int, desired: int) -> None:
        self._fleet[app] = {"current": current, "target": target, "desired": desired,
                              "at": time.time()}

    def fleet(self) -> dict[str, dict[str, float]]:
        return dict(self._fleet)


def get_registry() -> Any:
    """The registry actor handle; created (detached) on first use from any process."""
    return MetricsRegistry.options(name=REGISTRY_NAME, namespace=REGISTRY_NAMESPACE, lifetime="detached",
                                   get_if_exists=True).remote()


class MetricsEndpoint:
    """One replica's own /metrics server plus the lease that advertises it."""

    def __init__(self, role: str, labels: dict[str, str], host: str | None = None) -> None:
        from prometheus_client import start_http_server

        self.host = host or ray.util.get_node_ip_address()
        self._server, _ = start_http_server(0, addr=self.host)
        self.port = int(self._server.server_port)
        self.address = f"{self.host}:{self.port}"
        self.key = f"{role}/{labels.get('replica', self.address)}"
        self.labels = {"conveyor_role": role, **labels}
        self._stop = threading.Event()
        self._registry = get_registry()
        self._renew()  # advertise at once: the first scrape should not wait a renew period
        self._thread = threading.Thread(target=self._run, name="conveyor-metrics-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        try:
            self._registry.register.remote(self.key, self.address, self.labels)
        except Exception:  # noqa: BLE001 - the registry restarts; the next renewal re-registers
            logger.warning("cannot register metrics endpoint %s", self.address, exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(RENEW_EVERY_S):
            self._renew()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._registry.unregister.remote(self.key)
        except Exception:  # noqa: BLE001 - at shutdown the registry may be gone already; the lease expires
            pass
        self._server.shutdown()
        self._server.server_close()


def start_replica_endpoint(role: str, model: str) -> MetricsEndpoint | None:
    """Start and advertise this Serve replica's endpoint; None (logged) if it cannot, since serving
    requests matters more than exporting metrics."""
    from ray import serve

    try:
        ctx = serve.get_replica_context()
        labels = {"conveyor_app": ctx.app_name, "conveyor_deployment": ctx.deployment,
                  "model": model, "replica": ctx.replica_id.unique_id}
        return MetricsEndpoint(role, labels)
    except Exception:  # noqa: BLE001
        logger.warning("metrics endpoint not started", exc_info=True)
        return None


class FleetGauges:
    """In the ingress: refresh conveyor_replicas_{current,target} from the registry every few seconds."""

    def __init__(self, model: str, app: str, every_s: float = 2.0) -> None:
        self.model, self.app, self.every_s = model, app, every_s
        # Got once: `get_registry` is a get-or-create through the GCS (the actor's options pickled each time),
        # which every 2 s was most of what this thread cost the ingress. Dropped on an error: the registry
        # may have restarted.
        self._registry: Any = None
        self._thread = threading.Thread(target=self._run, name="conveyor-fleet-gauges", daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        from conveyor.serving.metrics import REPLICAS_CURRENT, REPLICAS_TARGET

        if self._registry is None:
            self._registry = get_registry()
        registry = self._registry
        fleet = ray.get(registry.fleet.remote(), timeout=5).get(self.app)
        engines = [t for t in ray.get(registry.targets.remote(self.app), timeout=5)
                   if t["labels"].get("conveyor_role") == "engine"]
        # Without autoscaling nobody reports a target: the fleet is what is registered.
        fresh = fleet is not None and time.time() - fleet["at"] < 30
        current = fleet["current"] if fresh else len(engines)
        target = fleet["target"] if fresh else current
        REPLICAS_CURRENT.labels(self.model).set(current)
        REPLICAS_TARGET.labels(self.model).set(target)

    def _run(self) -> None:
        while True:
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - keep trying; a missing gauge shows on the dashboard
                logger.debug("fleet gauges refresh failed", exc_info=True)
                self._registry = None
            time.sleep(self.every_s)
