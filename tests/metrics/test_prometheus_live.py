"""A real Prometheus, configured like deploy/prometheus/prometheus.yml (http_sd from the ingress), scrapes a
live deployment with two engine replicas under load: every family for both replicas, every dashboard
expression returns data."""
from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import httpx
import pytest

from conveyor.serving.metrics import ENGINE_FAMILIES, FLEET_METRICS, INGRESS_FAMILIES, family_name
from tests.metrics.conftest import Prometheus, deploy, start_prometheus, stop_prometheus, wait_for
from tests.metrics.dashboards_util import DASHBOARDS, exprs, load, substitute

APP, PREFIX, MODEL = "metrics-prom", "/metrics-prom", "tiny-prom"
VARIABLES = {"model": MODEL, "replica": ".*", "__rate_interval": "30s", "ttft_slo_s": "2", "itl_slo_s": "0.2"}


@pytest.fixture(scope="module")
def base_url(metrics_cluster: str, tiny_model_dir) -> Iterator[str]:  # noqa: ANN001
    args = {"model": str(tiny_model_dir), "served_model_name": MODEL, "num_replicas": 2, "num_kv_blocks": 128,
            "max_num_seqs": 4, "torch_num_threads": 1, "num_cpus": 1}
    with deploy(args, APP, PREFIX):
        yield metrics_cluster + PREFIX


@pytest.fixture(scope="module")
def prom(base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    p = start_prometheus(f"{base_url}/metrics/targets", tmp_path_factory.mktemp("prometheus"))
    try:
        yield p
    finally:
        stop_prometheus(p)


def _load(base_url: str, seconds: float, clients: int = 6) -> int:
    """Streamed and plain completions with a shared prefix (prefix-cache hits), plus a bad request."""
    done = []
    stop = threading.Event()

    def worker(i: int) -> None:
        with httpx.Client(timeout=60) as c:
            n = 0
            while not stop.is_set():
                prompt = "The quick brown fox jumps over the lazy dog. " * 4 + str(i)
                body = {"model": MODEL, "prompt": prompt,
                        "max_tokens": 16 + (n % 3) * 8, "stream": n % 2 == 0, "temperature": 0.0}
                r = c.post(f"{base_url}/v1/completions", json=body)
                done.append(r.status_code)
                n += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    bad = {"model": MODEL, "prompt": "word " * 20000, "max_tokens": 4}  # longer than the model: 400
    httpx.post(f"{base_url}/v1/completions", json=bad, timeout=30)
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=60)
    return sum(1 for s in done if s == 200)


def test_targets_endpoint_lists_every_replica(base_url: str) -> None:
    targets = wait_for(lambda: (t := httpx.get(f"{base_url}/metrics/targets", timeout=10).json())
                       and len(t) == 3 and t, 30, "3 metrics targets")
    roles = sorted(t["labels"]["conveyor_role"] for t in targets)
    assert roles == ["engine", "engine", "ingress"]
    for t in targets:
        assert len(t["targets"]) == 1 and ":" in t["targets"][0]
        assert t["labels"]["conveyor_app"] == APP
        text = httpx.get(f"http://{t['targets'][0]}/metrics", timeout=10).text
        assert "conveyor_" in text


def test_prometheus_sees_both_replicas_and_every_dashboard_query(base_url: str, prom: Prometheus) -> None:
    wait_for(lambda: len([t for t in prom.targets() if t["health"] == "up"]) == 3, 60,
             "prometheus to scrape 3 targets")
    engines = {t["labels"]["replica"] for t in httpx.get(f"{base_url}/metrics/targets", timeout=10).json()
               if t["labels"]["conveyor_role"] == "engine"}
    assert len(engines) == 2
    assert _load(base_url, 12) > 10
    # Both replicas served traffic (the router spreads 6 clients); every engine family is scraped from each.
    wait_for(lambda: {s["metric"]["replica"] for s in prom.query(
        f'conveyor_generation_tokens_total{{model="{MODEL}"}} > 0')} == engines, 30,
             "generated tokens on both replicas")
    for family in ENGINE_FAMILIES:
        result = prom.query(f'{{__name__=~"{family}|{family}_bucket", model="{MODEL}"}}')
        assert {s["metric"]["replica"] for s in result} == engines, family
    for family in INGRESS_FAMILIES:  # the ingress's own counters, exposed (at 0) from its start
        result = prom.query(f'{family}{{model="{MODEL}"}}')
        assert result and all(s["metric"]["conveyor_role"] == "ingress" for s in result), (family, result)
    for metric in FLEET_METRICS:
        result = wait_for(lambda m=metric: prom.query(f'{family_name(m)}{{model="{MODEL}"}}'), 20,
                          family_name(metric))
        assert float(result[0]["value"][1]) == 2.0
    rejected = prom.query(f'sum(conveyor_requests_rejected_total{{model="{MODEL}"}})')
    assert float(rejected[0]["value"][1]) >= 1  # the bad request
    # Every dashboard panel's every expression returns data, with its variables substituted.
    empty, nan_only = [], []
    for path in DASHBOARDS:
        for title, expr in exprs(load(path)):
            result = prom.query(substitute(expr, VARIABLES))
            if not result:
                empty.append(f"{path.stem}: {title}: {expr}")
            elif all(math.isnan(float(s["value"][1])) for s in result):
                nan_only.append(f"{path.stem}: {title}")
    assert not empty, "\n".join(empty)
    assert not nan_only, nan_only


def test_policy_reads_p99_from_prometheus(base_url: str, prom: Prometheus) -> None:
    """With prometheus_url set, the autoscaling policy takes the fleet p99 TTFT/ITL from the histograms
    (PrometheusQueryMixin), not from the replicas' own windows."""
    from types import SimpleNamespace

    from conveyor.router.autoscaling import QueueAndLatencyPolicy

    _load(base_url, 4, clients=2)  # fresh samples inside the 1m rate window
    policy = QueueAndLatencyPolicy(prometheus_url=prom.url, model=MODEL, prometheus_fetch_interval_s=0.5,
                                   report_to_registry=False)
    ctx = SimpleNamespace(aggregated_metrics={}, total_queued_requests=0, current_num_replicas=2,
                          target_num_replicas=2, current_time=0.0)
    inputs = wait_for(lambda: (i := policy.inputs_from_context(ctx)).ttft_p99_s is not None
                      and i.itl_p99_s is not None and i, 30, "p99s from prometheus")
    expected = prom.query(policy._ttft_query)
    assert inputs.ttft_p99_s == pytest.approx(float(expected[0]["value"][1]), rel=0.5)
    assert 0 < inputs.itl_p99_s < 5
