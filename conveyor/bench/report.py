"""What a run's summaries say: the one-line summary per point, the markdown tables, and the capacities they cite
(`conveyor bench`, and the benchmarks that re-score saved runs)."""
from __future__ import annotations

import math

from conveyor.bench.metrics import attainment_interval


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def print_summary(name: str, s: dict) -> None:
    line = (f"{name:>12} rate={s['offered_rate']:<5g} done={s['completed']}/{s['num_requests']} "
            f"refused={s.get('refused', 0)} req/s={s['request_throughput']:.2f} tok/s={s['output_throughput']:.1f} "
            f"TTFT p50/p99={_ms(s['ttft_ms']['p50'])}/{_ms(s['ttft_ms']['p99'])} "
            f"TPOT p50/p99={_ms(s['tpot_ms']['p50'])}/{_ms(s['tpot_ms']['p99'])} "
            f"ITL p50/p99={_ms(s['itl_ms']['p50'])}/{_ms(s['itl_ms']['p99'])} ms")
    if "goodput" in s:
        line += (f" attainment={100 * s['attainment']:.0f}% (admitted {100 * s['attainment_admitted']:.0f}%)"
                 f" goodput={s['goodput']:.2f} req/s")
    print(line, flush=True)


def goodput_table(per_target: dict[str, list[dict]]) -> str:
    """Markdown, one row per (rate, target): SLO attainment over every request sent (a refused one misses), with
    its 95% interval, and over the admitted ones, goodput, refusals, latency percentiles and output tok/s."""
    lines = ["| rate | target | attainment (95% interval) | of admitted | goodput req/s | refused "
             "| TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms | out tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    rates = sorted({r["offered_rate"] for rows in per_target.values() for r in rows})
    for rate in rates:
        for name, rows in per_target.items():
            for r in (r for r in rows if r["offered_rate"] == rate):
                lines.append(goodput_row(name, r))
    caps = {n: attainment_capacity(rows) for n, rows in per_target.items()}
    if any(c is not None for c in caps.values()):
        lines += ["", "Capacity (highest rate with >= 90% attainment, and every lower rate too): "
                  + ", ".join(f"{n} {c:g} req/s" for n, c in caps.items() if c is not None)]
    return "\n".join(lines)


def goodput_row(name: str, r: dict) -> str:
    def pct(key: str) -> str:
        return "-" if key not in r or math.isnan(r[key]) else f"{100 * r[key]:.0f}%"

    def dist(key: str, qs: tuple[str, ...]) -> str:
        return "/".join(_ms(r[key][q]) for q in qs)

    good = f"{r['goodput']:.2f}" if "goodput" in r else "-"
    return (f"| {r['offered_rate']:g} | {name} | {_attainment_cell(r)} | {pct('attainment_admitted')} | {good} "
            f"| {r.get('refused', 0)} | {dist('ttft_ms', ('p50', 'p90', 'p99'))} "
            f"| {dist('tpot_ms', ('p50', 'p90', 'p99'))} | {dist('itl_ms', ('p50', 'p99'))} "
            f"| {dist('e2e_ms', ('p50', 'p99'))} | {r['output_throughput']:.1f} |")


def _attainment_cell(r: dict) -> str:
    """'90% (81-95)': the share of every request sent that met the SLO, with its 95% interval (Wilson) where the
    counts are known."""
    if "attainment" not in r or math.isnan(r["attainment"]):
        return "-"
    low, high = attainment_interval(r)
    share = f"{100 * r['attainment']:.0f}%"
    return share if math.isnan(low) else f"{share} ({100 * low:.0f}-{100 * high:.0f})"


def _highest_passing_run(rows: list[dict], passes) -> float:  # noqa: ANN001 - a predicate on one row
    """Highest swept rate such that it and every lower swept rate pass: a system that fails at 1.5 req/s but
    passes at 2 (a short run that had not yet shown its queue) gets 1, not 2. 0 if the lowest fails."""
    best = 0.0
    for r in sorted(rows, key=lambda r: r["offered_rate"]):
        if not passes(r):
            break
        best = r["offered_rate"]
    return best


def capacity(rows: list[dict], slo_ms: float, ttft_slo_ms: float | None = None, keep_up: float = 0.8) -> float:
    """Capacity at a p99 ITL SLO: every request completed, p99 ITL within the SLO and the system keeping up:
    TTFT p99 within ttft_slo_ms when one is given (a queue that grows shows up as TTFT), else an achieved
    request rate within keep_up of the offered one (biased low for short runs: the drain counts)."""
    def passes(r: dict) -> bool:
        if ttft_slo_ms is not None:
            keeps_up = r["ttft_ms"]["p99"] <= ttft_slo_ms
        else:
            keeps_up = r["request_throughput"] >= keep_up * r["offered_rate"]
        return (r["failed"] == 0 and not math.isnan(r["itl_ms"]["p99"]) and r["itl_ms"]["p99"] <= slo_ms
                and keeps_up)

    return _highest_passing_run(rows, passes)


def attainment_capacity(rows: list[dict], attainment: float = 0.9) -> float | None:
    """Capacity as the share of requests that met every goodput SLO (at least `attainment`, the DistServe
    definition), over the same monotone run of rates; None without --goodput."""
    if not rows or "good_requests" not in rows[0]:
        return None
    # a refused request counts as missing (num_requests is every request sent); the epsilon keeps 18 of 20 at 90%
    return _highest_passing_run(rows, lambda r: r["good_requests"] >= attainment * r["num_requests"] - 1e-9)


def score(per_target: dict[str, list[dict]], itl_slo_ms: float, goodput_slo: dict[str, float]) -> dict:
    """Capacities of measured rows (also to re-score a saved run under a changed capacity definition)."""
    caps = {n: capacity(rows, itl_slo_ms, goodput_slo.get("ttft")) for n, rows in per_target.items()}
    slo_caps = {n: attainment_capacity(rows) for n, rows in per_target.items()}
    return {"per_target": per_target, "capacity": caps, "itl_slo_ms": itl_slo_ms,
            "slo_attainment_capacity": slo_caps, "goodput_slo": goodput_slo}


def ratio_table(result: dict) -> str:
    """Markdown: per rate, each target's tok/s and p99 ITL, and the first target's ratio over each."""
    per_target, names = result["per_target"], list(result["per_target"])
    base = names[0]
    head = "| rate | " + " | ".join(f"{n} tok/s, p50/p99 ITL ms" for n in names) + " | " + " | ".join(
        f"{base}/{n} tok/s" for n in names[1:]) + " |"
    lines = [head, "|" + "---|" * (1 + len(names) + len(names) - 1)]
    for j, row in enumerate(per_target[base]):
        cells = [f"{row['offered_rate']:g}"]
        for n in names:
            r = per_target[n][j]
            cells.append(f"{r['output_throughput']:.1f}, {r['itl_ms']['p50']:.0f}/{r['itl_ms']['p99']:.0f}")
        for n in names[1:]:
            other = per_target[n][j]["output_throughput"]
            cells.append(f"{row['output_throughput'] / other:.2f}x" if other else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    caps = result["capacity"]
    lines.append("")
    ttft = (result.get("goodput_slo") or {}).get("ttft")
    lines.append(f"Capacity at p99 ITL <= {result['itl_slo_ms']:g} ms"
                 + (f" and p99 TTFT <= {ttft:g} ms" if ttft else "") + " (req/s): "
                 + ", ".join(f"{n} {c:g}" for n, c in caps.items()))
    lines += _capacity_ratios(caps, base, names)
    slo_caps = result.get("slo_attainment_capacity") or {}
    if any(c is not None for c in slo_caps.values()):
        lines.append(f"Capacity at >= 90% of requests meeting {result['goodput_slo']} (req/s): "
                     + ", ".join(f"{n} {c:g}" for n, c in slo_caps.items()))
        lines += _capacity_ratios(slo_caps, base, names)
    return "\n".join(lines)


def _capacity_ratios(caps: dict[str, float], base: str, names: list[str]) -> list[str]:
    lines = []
    for n in names[1:]:
        ratio = f"{caps[base] / caps[n]:.2f}x" if caps[n] else ("inf (other 0)" if caps[base] else "n/a")
        lines.append(f"capacity {base}/{n}: {ratio}")
    return lines
