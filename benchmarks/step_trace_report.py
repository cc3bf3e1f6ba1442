"""Where a run's time goes, step by step: a report of one or two engine step traces (CONVEYOR_STEP_TRACE files).

Steps are grouped by what they carry (decodes only, prefill only, or mixed) and by their number of rows (tokens),
which decides the kernel path on the CPU: up to the GGUF row limit (--gguf-max-rows, 64 by default with AVX2 or
AVX-512) the projections read the model's quantized blocks, and a decode-only step of that size runs its layers in
one C++ call (the decode stack); larger steps take the packed fp32 GEMM. Per group: steps, median and mean step time,
milliseconds per row, and its share of the run's wall time; then the time between steps (outside the engine's
step: waiting for work, the transport to the parent process) and the engine's busy share. With two traces (e.g.
`conveyor serve` and the same load in process) the groups are printed side by side.

    CONVEYOR_STEP_TRACE=/tmp/served.jsonl .venv/bin/conveyor serve ...          # then a load
    .venv/bin/python -m benchmarks.step_trace_report /tmp/served.jsonl [/tmp/inproc.jsonl] [--skip-s 30]
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

ROW_BINS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 1 << 30)


@dataclass
class Group:
    step_ms: list[float] = field(default_factory=list)
    num_rows: int = 0

    def add(self, step_s: float, rows: int) -> None:
        self.step_ms.append(step_s * 1000)
        self.num_rows += rows


@dataclass
class TraceSummary:
    groups: dict[tuple[str, str], Group]
    wall_s: float
    busy_s: float
    gaps_ms: list[float]
    num_steps: int


def load(path: Path, skip_s: float) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"{path}: no steps")
    start = records[0]["t"] + skip_s
    return [r for r in records if r["t"] >= start]


def kind_of(record: dict) -> str:
    if record["num_prefill_tokens"] == 0:
        return "decode"
    return "prefill" if record["num_decode_tokens"] == 0 else "mixed"


def rows_bin(rows: int) -> str:
    low = 1
    for high in ROW_BINS:
        if rows <= high:
            return f"{low}-{high}" if high < 1 << 30 else f">{low - 1}"
        low = high + 1
    raise AssertionError("unreachable")


def summarize(records: list[dict], idle_gap_s: float) -> TraceSummary:
    groups: dict[tuple[str, str], Group] = {}
    gaps = []
    for prev, record in zip([None, *records], records, strict=False):
        rows = record["num_scheduled_tokens"]
        groups.setdefault((kind_of(record), rows_bin(rows)), Group()).add(record["step_time_s"], rows)
        if prev is not None:
            gap = record["t"] - prev["t"] - record["step_time_s"]
            if gap < idle_gap_s:  # a longer one is the engine waiting for work, not overhead
                gaps.append(gap * 1000)
    wall_s = records[-1]["t"] - records[0]["t"] + records[0]["step_time_s"]
    busy_s = sum(r["step_time_s"] for r in records)
    return TraceSummary(groups, wall_s, busy_s, gaps, len(records))


def _group_cells(group: Group | None, wall_s: float) -> list[str]:
    if group is None:
        return ["-"] * 5
    total_ms = sum(group.step_ms)
    return [str(len(group.step_ms)), f"{statistics.median(group.step_ms):.1f}",
            f"{total_ms / len(group.step_ms):.1f}", f"{total_ms / max(group.num_rows, 1):.2f}",
            f"{total_ms / 1000 / wall_s:.0%}"]


def report(names: list[str], summaries: list[TraceSummary]) -> str:
    cols = ["steps", "p50 ms", "mean ms", "ms/row", "wall"]
    header = ["kind", "rows"] + [f"{name}: {c}" for name in names for c in cols]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    keys = sorted({k for s in summaries for k in s.groups},
                  key=lambda k: (k[0], int(k[1].split("-")[0].lstrip(">"))))
    for key in keys:
        cells = [c for s in summaries for c in _group_cells(s.groups.get(key), s.wall_s)]
        lines.append("| " + " | ".join([*key, *cells]) + " |")
    lines.append("")
    for name, s in zip(names, summaries, strict=True):
        gaps = sorted(s.gaps_ms) or [0.0]
        lines.append(f"{name}: {s.num_steps} steps over {s.wall_s:.1f} s; engine busy {s.busy_s / s.wall_s:.0%}; "
                     f"between steps p50 {statistics.median(gaps):.2f} ms, p99 {gaps[int(0.99 * (len(gaps) - 1))]:.2f}"
                     f" ms, total {sum(gaps) / 1000 / s.wall_s:.1%} of the wall")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path, help="one or two CONVEYOR_STEP_TRACE files")
    p.add_argument("--skip-s", type=float, default=0.0, help="leave out the first seconds of each trace (warm-up)")
    p.add_argument("--idle-gap-ms", type=float, default=50.0,
                   help="a gap between steps longer than this is the engine idle, not overhead")
    args = p.parse_args(argv)
    if len(args.traces) > 2:
        p.error("at most two traces")
    summaries = [summarize(load(path, args.skip_s), args.idle_gap_ms / 1000) for path in args.traces]
    print(report([path.stem for path in args.traces], summaries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
