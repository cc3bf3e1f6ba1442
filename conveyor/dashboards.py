"""`conveyor dashboards push`: upload the JSON dashboards in dashboards/ to a Grafana through its HTTP API.

Uses `grafana-api` (GrafanaFace): POST /api/dashboards/db with {"dashboard", "overwrite": true, "folderUid"}
and `Authorization: Bearer <api key>`. With --folder, the folder is looked up by title and created if missing.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

DASHBOARDS_DIR = Path(__file__).resolve().parent.parent / "dashboards"


def load_dashboards(directory: Path = DASHBOARDS_DIR) -> list[dict[str, Any]]:
    files = sorted(directory.glob("*.json"))
    if not files:
        raise ValueError(f"no dashboard JSON files in {directory}")
    return [json.loads(f.read_text()) for f in files]


def grafana_client(url: str, api_key: str, timeout_s: float = 10.0) -> Any:
    from grafana_api.grafana_face import GrafanaFace

    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname:
        raise ValueError(f"not a Grafana URL: {url!r}")
    prefix = parts.path.strip("/")
    # GrafanaFace builds "{protocol}://{host}:{port}/{prefix}api": the prefix needs its trailing slash.
    return GrafanaFace(auth=api_key, host=parts.hostname, port=parts.port, protocol=parts.scheme,
                       url_path_prefix=f"{prefix}/" if prefix else "", timeout=timeout_s)


def ensure_folder(grafana: Any, title: str) -> str:
    for folder in grafana.folder.get_all_folders():
        if folder.get("title") == title:
            return folder["uid"]
    return grafana.folder.create_folder(title)["uid"]


def push(url: str, api_key: str, folder: str | None = None,
         directory: Path = DASHBOARDS_DIR) -> list[dict[str, Any]]:
    """Create or overwrite every dashboard; returns Grafana's answers (uid, url, version, status)."""
    grafana = grafana_client(url, api_key)
    folder_uid = ensure_folder(grafana, folder) if folder else None
    results = []
    for dashboard in load_dashboards(directory):
        body: dict[str, Any] = {"dashboard": {**dashboard, "id": None}, "overwrite": True,
                                "message": "pushed by conveyor dashboards push"}
        if folder_uid:
            body["folderUid"] = folder_uid
        else:
            body["folderId"] = 0  # General
        results.append(grafana.dashboard.update_dashboard(body))
    return results
