"""Reading the dashboards the way the tests need: every PromQL expression, variables substituted."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DASHBOARDS = sorted((Path(__file__).resolve().parents[2] / "dashboards").glob("*.json"))
IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
PROMQL_WORDS = {"sum", "max", "min", "avg", "by", "on", "ignoring", "group_left", "group_right", "rate",
                "irate", "increase", "histogram_quantile", "vector", "clamp_min", "without", "and", "or",
                "unless", "label_values", "le", "bool", "offset"}


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # rows


def exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def metric_names(expr: str) -> set[str]:
    """Identifiers in an expression that are metric names (not functions, labels, or keywords)."""
    stripped = re.sub(r'"[^"]*"', '""', expr)  # label values
    stripped = re.sub(r"\{[^}]*\}", "{}", stripped)  # label matchers
    stripped = re.sub(r"\[[^\]]*\]", "[]", stripped)  # range selectors
    stripped = re.sub(r"\b(by|on|ignoring|without)\s*\([^)]*\)", "", stripped)  # grouping labels
    stripped = re.sub(r"\$\{?\w+\}?", "1", stripped)  # dashboard variables
    names = {m.group(0) for m in IDENT.finditer(stripped)} - PROMQL_WORDS
    return {n for n in names if not n.isdigit()}


def substitute(expr: str, values: dict[str, str]) -> str:
    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)
