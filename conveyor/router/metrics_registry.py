"""How every replica's metrics reach Prometheus from every node with one scrape config.

Each Serve replica (engine or ingress) serves its own process' prometheus-client registry on an ephemeral
port bound to its node's IP (`start_http_server(0)`: no port collisions however many replicas share a
host), and registers `ip:port` with labels in the cluster's key-value store (Ray's GCS, namespace `conveyor`).
Registrations are leases, renewed every few seconds by a daemon thread: a replica that dies or is removed simply
stops renewing and drops out of the list within `LEASE_S`, with no dependency on Serve internals.

The ingress serves the live list at `GET /metrics/targets` in Prometheus' HTTP service-discovery format,
so `deploy/prometheus/prometheus.yml` needs one `http_sd_configs` entry pointing at the Serve HTTP port.
The autoscaling policy (inside the ServeController) reports the fleet's current/target replica counts
here too; the ingress turns them into the `conveyor_replicas_*` gauges.

The store is the GCS, not an actor of ours: a Ray worker process costs ~0.01 of a core and ~150 wake-ups a
second while idle, each a moment taken from the engine's OpenMP team on a small machine (RESULTS.md). Its calls
block (gRPC to the GCS): the ingress makes them off its event loop.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import ray

logger = logging.getLogger(__name__)

KV_NAMESPACE = "conveyor"
TARGET_PREFIX = "metrics/target/"
FLEET_PREFIX = "metrics/fleet/"
LEASE_S = 15.0
RENEW_EVERY_S = 3.0
UNREGISTER_WAIT_S = 2.0  # how long close() waits for the lease's withdrawal


def _kv() -> Any:
    from ray.experimental import internal_kv

    return internal_kv


def register_target(key: str, address: str, labels: dict[str, str], lease_s: float = LEASE_S) -> None:
    record = {"address": address, "labels": dict(labels), "expires_at": time.time() + lease_s}
    _kv()._internal_kv_put(TARGET_PREFIX + key, json.dumps(record), overwrite=True, namespace=KV_NAMESPACE)


def unregister_target(key: str) -> None:
    _kv()._internal_kv_del(TARGET_PREFIX + key, namespace=KV_NAMESPACE)


def live_targets(app: str | None = None) -> list[dict[str, Any]]:
    """Live targets in http_sd format: [{"targets": ["ip:port"], "labels": {...}}]; expired leases are removed."""
    kv, now, live = _kv(), time.time(), []
    for key in kv._internal_kv_list(TARGET_PREFIX, namespace=KV_NAMESPACE):
        raw = kv._internal_kv_get(key, namespace=KV_NAMESPACE)
        if raw is None:  # unregistered meanwhile
            continue
        record = json.loads(raw)
        if record["expires_at"] < now:
            kv._internal_kv_del(key, namespace=KV_NAMESPACE)
        elif app is None or record["labels"].get("conveyor_app") == app:
            live.append(record)
    live.sort(key=lambda r: (r["address"], sorted(r["labels"].items())))
    return [{"targets": [r["address"]], "labels": r["labels"]} for r in live]


def report_fleet(app: str, current: int, target: int, desired: int) -> None:
    record = {"current": current, "target": target, "desired": desired, "at": time.time()}
    _kv()._internal_kv_put(FLEET_PREFIX + app, json.dumps(record), overwrite=True, namespace=KV_NAMESPACE)


def read_fleet(app: str) -> dict[str, float] | None:
    raw = _kv()._internal_kv_get(FLEET_PREFIX + app, namespace=KV_NAMESPACE)
    return None if raw is None else json.loads(raw)


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
        self._renew()  # advertise at once: the first scrape should not wait a renew period
        self._thread = threading.Thread(target=self._run, name="conveyor-metrics-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        try:
            register_target(self.key, self.address, self.labels)
        except Exception:  # noqa: BLE001 - the GCS may be restarting; the next renewal re-registers
            logger.warning("cannot register metrics endpoint %s", self.address, exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(RENEW_EVERY_S):
            self._renew()

    def close(self) -> None:
        """Stop serving and withdraw the lease. The withdrawal is a GCS call, and close() runs from a replica's
        __del__: with the GCS gone (the cluster stopping) that call would wait on Ray's reconnect timeout, so it
        runs on a daemon thread given UNREGISTER_WAIT_S; if it does not finish, the lease lapses on its own."""
        if self._stop.is_set():
            return
        self._stop.set()
        withdraw = threading.Thread(target=self._unregister, name="conveyor-metrics-unregister", daemon=True)
        withdraw.start()
        self._server.shutdown()
        self._server.server_close()
        withdraw.join(UNREGISTER_WAIT_S)

    def _unregister(self) -> None:
        try:
            unregister_target(self.key)
        except Exception:  # noqa: BLE001 - at shutdown the GCS may be gone already; the lease expires
            pass


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
    """In the ingress: refresh conveyor_replicas_{current,target} from the store every few seconds."""

    def __init__(self, model: str, app: str, every_s: float = 2.0, start: bool = True) -> None:
        self.model, self.app, self.every_s = model, app, every_s
        if start:  # start=False: refresh() only when called (tests)
            threading.Thread(target=self._run, name="conveyor-fleet-gauges", daemon=True).start()

    def refresh(self) -> None:
        from conveyor.serving.metrics import REPLICAS_CURRENT, REPLICAS_TARGET

        fleet = read_fleet(self.app)
        engines = [t for t in live_targets(self.app) if t["labels"].get("conveyor_role") == "engine"]
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
            time.sleep(self.every_s)
