"""deploy/k8s manifests: they parse, name a real builder with valid args, and their ports line up."""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def load(name: str) -> dict[str, Any]:
    docs = list(yaml.safe_load_all((K8S / name).read_text()))
    assert len(docs) == 1, name
    return docs[0]


@pytest.fixture(scope="module")
def service() -> dict[str, Any]:
    return load("rayservice.yaml")


@pytest.fixture(scope="module")
def serve_config(service: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def groups(service: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = service["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def ray_container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


def ports(group: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in ray_container(group)["ports"]}


def test_kinds(service: dict[str, Any]) -> None:
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    monitor = load("podmonitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")


def test_import_path_names_a_real_builder(serve_config: dict[str, Any]) -> None:
    (app,) = serve_config["applications"]
    module, _, attr = app["import_path"].partition(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    # Read the source rather than import it: the check must not depend on Ray starting here.
    tree = ast.parse(Path(spec.origin).read_text())
    assert attr in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, attr


def test_args_are_valid_serve_args(serve_config: dict[str, Any]) -> None:
    from conveyor.router.app import ServeArgs

    args = ServeArgs.model_validate(serve_config["applications"][0]["args"])  # extra keys are refused
    assert args.num_gpus == 1


def test_ports_line_up(service: dict[str, Any], serve_config: dict[str, Any]) -> None:
    http_port = serve_config["http_options"]["port"]
    for group in groups(service):
        p = ports(group)
        assert p["serve"] == http_port  # proxies run on every node (proxy_location: EveryNode)
        assert p["metrics"] == int(group["rayStartParams"]["metrics-export-port"])
    head = ports(service["spec"]["rayClusterConfig"]["headGroupSpec"])
    assert {"gcs-server", "dashboard", "client"} <= set(head)


def test_probes_use_readiness_and_the_nodes_own_proxy(service: dict[str, Any],
                                                        serve_config: dict[str, Any]) -> None:
    """Readiness is the ingress's /ready (an engine replica is loaded and not wedged); liveness is the node's own
    Serve proxy, so one node's pod is never restarted because an engine elsewhere is down."""
    http_port = serve_config["http_options"]["port"]
    for group in groups(service):
        container = ray_container(group)
        assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": http_port}
        assert container["livenessProbe"]["httpGet"] == {"path": "/-/healthz", "port": http_port}


def test_podmonitor_selects_every_ray_pod(service: dict[str, Any]) -> None:
    spec = load("podmonitor.yaml")["spec"]
    wanted = dict(spec["selector"]["matchLabels"])
    assert wanted.pop("ray.io/is-ray-node") == "yes"  # KubeRay's label on every Ray pod
    for group in groups(service):
        labels = group["template"]["metadata"]["labels"]
        assert wanted.items() <= labels.items()
        assert {e["port"] for e in spec["podMetricsEndpoints"]} <= set(ports(group))


def test_gpu_group_fits_one_engine_replica_per_pod(service: dict[str, Any],
                                                   serve_config: dict[str, Any]) -> None:
    args = serve_config["applications"][0]["args"]
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == importlib.metadata.version("ray")  # pods run what we test
    gpu = next(g for g in cluster["workerGroupSpecs"] if g["groupName"] == "gpu")
    resources = ray_container(gpu)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1 == args["num_gpus"]
    assert args["num_cpus"] <= float(resources["requests"]["cpu"])
    assert args["num_replicas"] <= gpu["maxReplicas"]


def test_scrapeconfig_discovers_replicas_through_the_serve_service(serve_config: dict[str, Any]) -> None:
    scrape = load("scrapeconfig.yaml")
    assert (scrape["apiVersion"], scrape["kind"]) == ("monitoring.coreos.com/v1alpha1", "ScrapeConfig")
    (sd,) = scrape["spec"]["httpSDConfigs"]
    assert sd["url"] == f"http://conveyor-serve-svc:{serve_config['http_options']['port']}/metrics/targets"
    ingress = Path(importlib.util.find_spec("conveyor.router.ingress").origin).read_text()
    assert '"/metrics/targets"' in ingress  # the route the URL names exists


def test_the_cluster_keeps_token_auth_and_the_key_comes_from_a_secret(service: dict[str, Any],
                                                                        serve_config: dict[str, Any]) -> None:
    assert service["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    args = serve_config["applications"][0]["args"]
    assert "api_key" not in args and args["api_key_file"].startswith("/etc/conveyor/api-key/")
    for group in groups(service):  # an ingress replica may land on any pod: each mounts the Secret
        spec = group["template"]["spec"]
        volume = next(v for v in spec["volumes"] if v["name"] == "api-key")
        assert volume["secret"]["secretName"] == "conveyor-api-key" and not volume["secret"].get("optional")
        mounts = {m["name"]: m["mountPath"] for m in ray_container(group)["volumeMounts"]}
        assert args["api_key_file"].startswith(mounts["api-key"] + "/")
        assert not any("API_KEY" in e.get("name", "") and "value" in e for e in ray_container(group).get("env", []))


def test_network_policy_opens_only_the_api_port_to_outsiders(service: dict[str, Any],
                                                              serve_config: dict[str, Any]) -> None:
    policy = load("networkpolicy.yaml")
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    for group in groups(service):  # it selects every pod
        assert spec["podSelector"]["matchLabels"].items() <= group["template"]["metadata"]["labels"].items()
    open_to_all = [rule for rule in spec["ingress"] if "from" not in rule]
    assert [p["port"] for rule in open_to_all for p in rule["ports"]] == [serve_config["http_options"]["port"]]
    for rule in spec["ingress"]:
        for peer in rule.get("from", []):
            assert "ipBlock" not in peer  # no address range reaches Ray's ports
