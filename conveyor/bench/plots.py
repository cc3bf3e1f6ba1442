"""PNG figures: latency vs throughput across request rates, ITL over time, and SLO attainment and goodput
against the offered rate.

matplotlib is not a dependency of `conveyor` (it is in the `bench` and `dev` extras): it is imported when a figure
is drawn, so the benchmark itself runs without it and `conveyor bench` skips its PNGs (see `plots_available`).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from conveyor.bench.metrics import attainment_interval

MISSING_MATPLOTLIB = "matplotlib is not installed: no PNG figures (pip install 'conveyor[bench]' for them)"


def plots_available() -> bool:
    """Whether matplotlib can be imported (the figures' only extra requirement)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # sys.modules["matplotlib"] is None or has no spec: treat as absent
        return False


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless: never open a window
    import matplotlib.pyplot as plt

    return plt


def plot_curves(per_target: dict[str, list[dict]], path: Path, slo_ms: float | None = None) -> None:
    """per_target: name -> summaries (one per rate). Left: p99 ITL; middle: p50 ITL; right: p99 TTFT,
    each against achieved output-token throughput."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("itl_ms", "p99", "p99 ITL (ms)"), ("itl_ms", "p50", "p50 ITL (ms)"),
              ("ttft_ms", "p99", "p99 TTFT (ms)")]
    for ax, (metric, q, label) in zip(axes, panels, strict=True):
        for name, rows in per_target.items():
            xs = [r["output_throughput"] for r in rows]
            ys = [r[metric][q] for r in rows]
            ax.plot(xs, ys, marker="o", label=name)
            for r, x, y in zip(rows, xs, ys, strict=True):
                ax.annotate(f"{r['offered_rate']:g}", (x, y), fontsize=7, textcoords="offset points",
                            xytext=(3, 3))
        if slo_ms is not None and metric == "itl_ms" and q == "p99":
            ax.axhline(slo_ms, color="red", linestyle="--", linewidth=1, label=f"SLO {slo_ms:g} ms")
        ax.set_xlabel("output throughput (tok/s); labels = offered req/s")
        ax.set_ylabel(label)
        _log_if_positive(ax)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    _save(plt, fig, path)


def plot_itl_timeline(series: dict[str, tuple[list[float], list[float]]], path: Path, title: str = "",
                      marks: list[float] | None = None) -> None:
    """series: name -> (times s, ITL ms); marks: times of notable events (e.g. long-prompt arrivals)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4))
    for name, (ts, itl) in series.items():
        ax.scatter(ts, itl, s=4, alpha=0.6, label=name)
    for m in marks or []:
        ax.axvline(m, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("inter-token latency (ms)")
    _log_if_positive(ax)
    ax.set_title(title)
    ax.legend(markerscale=3, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    _save(plt, fig, path)


def plot_goodput(per_target: dict[str, list[dict]], path: Path, title: str, slo: dict[str, float],
                 attainment: float = 0.9) -> None:
    """per_target: name -> summaries with goodput figures. Left: SLO attainment (share of every request sent, a
    refused one missing, with its 95% interval) against the offered rate, the `attainment` line drawn; right:
    goodput against the offered rate, with goodput = offered rate (every request good) drawn."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    rates = sorted({r["offered_rate"] for rows in per_target.values() for r in rows})
    for name, rows in per_target.items():
        rows = sorted(rows, key=lambda r: r["offered_rate"])
        xs = [r["offered_rate"] for r in rows]
        shares = [100 * r.get("attainment", float("nan")) for r in rows]
        # The 95% interval (Wilson) where the counts are known: a few points apart can be the same server.
        bounds = [[100 * b for b in attainment_interval(r)] for r in rows]
        errors = [[max(s - lo, 0.0) for s, (lo, _) in zip(shares, bounds, strict=True)],
                  [max(hi - s, 0.0) for s, (_, hi) in zip(shares, bounds, strict=True)]]
        left.errorbar(xs, shares, yerr=errors, marker="o", capsize=3, label=name)
        right.plot(xs, [r.get("goodput", float("nan")) for r in rows], marker="o", label=name)
    left.axhline(100 * attainment, color="red", linestyle="--", linewidth=1,
                 label=f"{100 * attainment:g}% (capacity)")
    left.set_ylim(0, 105)
    left.set_ylabel("requests meeting the SLO (% of sent)")
    right.plot(rates, rates, color="grey", linestyle=":", linewidth=1, label="all requests good")
    right.set_ylim(bottom=0)
    right.set_ylabel("goodput (req/s meeting the SLO)")
    for ax in (left, right):
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    slo_text = ", ".join(f"{k} <= {v:g} ms" for k, v in slo.items())
    fig.suptitle(f"{title}\nSLO: {slo_text}", fontsize=10)
    _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _log_if_positive(ax: Any) -> None:  # a matplotlib Axes
    """Log scale (latencies span decades) unless nothing positive was measured, e.g. every request failed."""
    if ax.dataLim.ymax > 0 and ax.has_data():
        ax.set_yscale("log")
