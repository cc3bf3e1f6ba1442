"""The dashboards are well-formed, use only defined metrics and the datasource variable; push speaks
Grafana's dashboard API (checked by a local stand-in server, since no Grafana is installable here)."""
from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import Histogram

from conveyor.serving.metrics import METRICS, family_name
from tests.metrics.dashboards_util import DASHBOARDS, exprs, load, metric_names, panels

DS = "${datasource}"


def exposed_series_names() -> set[str]:
    """Every series name a PromQL expression may use (histograms add _bucket/_sum/_count)."""
    names: set[str] = set()
    for metric in METRICS:
        name = family_name(metric)
        if isinstance(metric, Histogram):
            names.update({name + "_bucket", name + "_sum", name + "_count"})
        else:
            names.add(name)
    return names


def test_there_are_two_dashboards() -> None:
    assert {p.name for p in DASHBOARDS} == {"conveyor-overview.json", "conveyor-engine.json"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_shape(path) -> None:  # noqa: ANN001
    d = load(path)
    assert d["uid"] and d["title"] and isinstance(d["panels"], list) and d["panels"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids))
    for panel in panels(d):
        assert panel["datasource"]["uid"] == DS, panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"]
            assert target["datasource"]["uid"] == DS
            assert target.get("legendFormat"), panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
    for var in variables.values():  # query variables read through the datasource variable too
        if var["type"] == "query":
            assert var["datasource"]["uid"] == DS


def test_per_replica_legends_name_the_replica() -> None:
    engine = load(next(p for p in DASHBOARDS if p.stem == "conveyor-engine"))
    for panel in panels(engine):
        for target in panel["targets"]:
            assert "{{replica}}" in target["legendFormat"], panel["title"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_only_defined_metrics(path) -> None:  # noqa: ANN001
    defined = exposed_series_names()
    d = load(path)
    used = set()
    for title, expr in exprs(d):
        names = metric_names(expr)
        assert names <= defined, (title, names - defined)
        used |= names
    for var in d["templating"]["list"]:
        if var["type"] == "query":  # label_values(<series selector>, <label>)
            selector = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["definition"]).group(1)
            assert metric_names(selector) <= defined
    assert used, "no metrics used at all"


def test_metric_name_extraction() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, replica) (rate(conveyor_x_bucket{model=~"$model", '
            'replica="a b"}[$__rate_interval]))) / on (replica) group_left vector($slo)')
    assert metric_names(expr) == {"conveyor_x_bucket"}


# ---- conveyor dashboards push against a stand-in Grafana ---------------------------------------------
class FakeGrafana(BaseHTTPRequestHandler):
    key = "test-key"
    received: list[tuple[str, str, Any]] = []
    folders: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") != f"Bearer {self.key}":
            self._reply(401, {"message": "Unauthorized"})
            return False
        return True

    def do_GET(self) -> None:  # noqa: N802
        self.received.append(("GET", self.path, None))
        if not self._authorized():
            return
        if self.path == "/api/folders":
            return self._reply(200, self.folders)
        self._reply(404, {"message": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length", 0))
        assert self.headers.get("Content-Type", "").startswith("application/json")
        body = json.loads(self.rfile.read(length))
        self.received.append(("POST", self.path, body))
        if not self._authorized():
            return
        if self.path == "/api/folders":
            folder = {"id": len(self.folders) + 1, "uid": f"f{len(self.folders) + 1}", "title": body["title"]}
            self.folders.append(folder)
            return self._reply(200, folder)
        if self.path == "/api/dashboards/db":
            d = body.get("dashboard")
            ok = (isinstance(d, dict) and d.get("uid") and d.get("title") and d.get("id") is None
                  and body.get("overwrite") is True and ("folderUid" in body or "folderId" in body))
            if not ok:
                return self._reply(400, {"message": "bad dashboard request", "status": "bad-request"})
            return self._reply(200, {"id": 1, "uid": d["uid"], "url": f"/d/{d['uid']}/x", "status": "success",
                                     "version": 1, "slug": "x"})
        self._reply(404, {"message": "not found"})


@pytest.fixture()
def grafana() -> Iterator[str]:
    FakeGrafana.received, FakeGrafana.folders = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeGrafana)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_push_cli_follows_grafana_dashboard_api(grafana: str, capsys: pytest.CaptureFixture[str]) -> None:
    from conveyor.cli import main

    assert main(["dashboards", "push", "--url", grafana, "--api-key", "test-key", "--folder", "LLM"]) == 0
    posts = [(path, body) for method, path, body in FakeGrafana.received if method == "POST"]
    assert posts[0] == ("/api/folders", {"title": "LLM"})
    pushed = [body for path, body in posts if path == "/api/dashboards/db"]
    assert sorted(b["dashboard"]["uid"] for b in pushed) == ["conveyor-engine", "conveyor-overview"]
    assert all(b["folderUid"] == "f1" and b["overwrite"] is True for b in pushed)
    assert capsys.readouterr().out.count("success") == 2
    # A second push reuses the folder instead of creating another, and lands in the same place.
    assert main(["dashboards", "push", "--url", grafana, "--api-key", "test-key", "--folder", "LLM"]) == 0
    assert len(FakeGrafana.folders) == 1


def test_push_without_folder_and_bad_key(grafana: str) -> None:
    from conveyor.dashboards import push

    results = push(grafana, "test-key")
    assert [r["status"] for r in results] == ["success", "success"]
    body = [b for m, p, b in FakeGrafana.received if p == "/api/dashboards/db"][0]
    assert body["folderId"] == 0
    with pytest.raises(Exception, match="Unauthorized"):
        push(grafana, "wrong-key")
