"""The metrics registry's keys in Ray's GCS (conveyor/router/metrics_registry.py): leases that lapse, the
per-application view Prometheus' service discovery reads, and the fleet counts the ingress turns into gauges."""
from __future__ import annotations

import socket
import threading
import time

import pytest
from prometheus_client import REGISTRY

from conveyor.router import metrics_registry as registry

APP = "conveyor-test-metrics-registry"
OTHER_APP = APP + "-other"


def _labels(app: str, replica: str) -> dict[str, str]:
    return {"conveyor_role": "engine", "conveyor_app": app, "replica": replica}


def test_leases_list_per_app_and_lapse_unless_renewed(serve_cluster: str) -> None:
    registry.register_target("engine/a", "10.0.0.2:9001", _labels(APP, "a"), lease_s=60)
    registry.register_target("engine/b", "10.0.0.1:9002", _labels(APP, "b"), lease_s=0.5)
    registry.register_target("engine/c", "10.0.0.3:9003", _labels(OTHER_APP, "c"), lease_s=60)
    try:
        listed = registry.live_targets(APP)
        assert [t["targets"] for t in listed] == [["10.0.0.1:9002"], ["10.0.0.2:9001"]]  # sorted by address
        assert listed[1]["labels"] == _labels(APP, "a")
        time.sleep(0.6)
        assert [t["targets"] for t in registry.live_targets(APP)] == [["10.0.0.2:9001"]]
        # The lapsed lease was removed from the store, not only left out.
        assert registry.TARGET_PREFIX + "engine/b" not in _stored_keys()
        registry.register_target("engine/b", "10.0.0.1:9002", _labels(APP, "b"), lease_s=60)  # a renewal
        registry.unregister_target("engine/a")
        assert [t["targets"] for t in registry.live_targets(APP)] == [["10.0.0.1:9002"]]
        assert {t["targets"][0] for t in registry.live_targets()} >= {"10.0.0.1:9002", "10.0.0.3:9003"}
    finally:
        for key in ("engine/a", "engine/b", "engine/c"):
            registry.unregister_target(key)


def test_fleet_counts_reach_the_replica_gauges(serve_cluster: str) -> None:
    model = "fleet-test-model"
    registry.register_target("engine/f1", "10.0.0.9:9009", _labels(APP, "f1"), lease_s=60)
    try:
        gauges = registry.FleetGauges(model, APP, start=False)
        assert registry.read_fleet(APP) is None
        gauges.refresh()  # nobody reported: the fleet is what is registered
        assert _gauge("conveyor_replicas_current", model) == 1
        assert _gauge("conveyor_replicas_target", model) == 1
        registry.report_fleet(APP, current=2, target=3, desired=3)
        assert registry.read_fleet(APP)["target"] == 3
        gauges.refresh()
        assert _gauge("conveyor_replicas_current", model) == 2
        assert _gauge("conveyor_replicas_target", model) == 3
    finally:
        registry.unregister_target("engine/f1")
        registry._kv()._internal_kv_del(registry.FLEET_PREFIX + APP, namespace=registry.KV_NAMESPACE)


def _stored_keys() -> set[str]:
    keys = registry._kv()._internal_kv_list(registry.TARGET_PREFIX, namespace=registry.KV_NAMESPACE)
    return {k.decode() if isinstance(k, bytes) else k for k in keys}


def _gauge(name: str, model: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"model": model})


def test_close_does_not_wait_on_an_unreachable_store(monkeypatch) -> None:
    """close() runs from a replica's __del__: with the GCS gone the lease's withdrawal would block on Ray's
    reconnect timeout. It gets UNREGISTER_WAIT_S on a thread of its own; the lease then lapses by itself."""
    store_answers = threading.Event()
    monkeypatch.setattr(registry, "register_target", lambda *args, **kwargs: None)
    monkeypatch.setattr(registry, "unregister_target", lambda key: store_answers.wait(5))
    monkeypatch.setattr(registry, "UNREGISTER_WAIT_S", 0.05, raising=False)
    endpoint = registry.MetricsEndpoint("engine", {"replica": "r"}, host="127.0.0.1")
    try:
        endpoint.close()
        withdrawing = [t for t in threading.enumerate() if t.name == "conveyor-metrics-unregister"]
        assert withdrawing and withdrawing[0].is_alive()  # close() returned while the store still did not answer
        with pytest.raises(OSError):  # and the /metrics server is down
            socket.create_connection(("127.0.0.1", endpoint.port), timeout=1).close()
    finally:
        store_answers.set()
