"""Per-request timings and their summary (percentiles, throughput, goodput), as `vllm bench serve` reports."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class RequestResult:
    send_time: float  # s since the run started
    prompt_len: int
    max_tokens: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0  # s from send to the first token
    e2e: float = 0.0  # s from send to the last byte
    itls: list[float] = field(default_factory=list)  # each gap between token-bearing chunks
    chunk_times: list[float] = field(default_factory=list)  # arrival times of those chunks (run clock)
    output_tokens: int = 0

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for one-token outputs)."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    def record_chunk(self, now: float, send: float, t0: float) -> None:
        """A token-bearing chunk arrived at `now` (same clock as `send` and the run start `t0`)."""
        if self.chunk_times:
            self.itls.append(now - t0 - self.chunk_times[-1])
        else:
            self.ttft = now - send
        self.chunk_times.append(now - t0)

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean/p50/p90/p99/max in ms (values in s)."""
    if not values:
        return {k: math.nan for k in ("mean", "p50", "p90", "p99", "max")}
    return {"mean": scale * sum(values) / len(values), "p50": scale * percentile(values, 50),
            "p90": scale * percentile(values, 90), "p99": scale * percentile(values, 99),
            "max": scale * max(values)}


def meets_slo(r: RequestResult, ttft_ms: float | None, itl_ms: float | None) -> bool:
    """Goodput counts a request only when it finished and met every SLO given. The ITL SLO applies to
    each gap (vLLM applies its `tpot` SLO to the mean; each gap is what a reader of the stream feels)."""
    if not r.ok:
        return False
    if ttft_ms is not None and r.ttft * 1000 > ttft_ms:
        return False
    return not (itl_ms is not None and r.itls and max(r.itls) * 1000 > itl_ms)


def summarize(results: list[RequestResult], duration_s: float, offered_rate: float,
              goodput: dict[str, float] | None = None) -> dict:
    done = [r for r in results if r.ok]
    itls = [g for r in done for g in r.itls]
    out_tokens = sum(r.output_tokens for r in done)
    summary = {
        "offered_rate": offered_rate, "num_requests": len(results), "completed": len(done),
        "failed": len(results) - len(done), "duration_s": duration_s,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
        "total_output_tokens": out_tokens,
        "ttft_ms": distribution([r.ttft for r in done]),
        "tpot_ms": distribution([r.tpot for r in done if r.output_tokens > 1]),
        "itl_ms": distribution(itls),
        "e2e_ms": distribution([r.e2e for r in done]),
    }
    if goodput:
        good = sum(meets_slo(r, goodput.get("ttft"), goodput.get("itl")) for r in results)
        summary["goodput_slo"] = goodput
        summary["good_requests"] = good
        summary["goodput"] = good / duration_s if duration_s > 0 else 0.0
    return summary


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """['ttft:2000', 'itl:300'] -> {'ttft': 2000.0, 'itl': 300.0}."""
    out: dict[str, float] = {}
    for spec in specs or []:
        key, _, value = spec.partition(":")
        if key not in ("ttft", "itl") or not value:
            raise ValueError(f"bad --goodput entry {spec!r}; expected ttft:MS or itl:MS")
        out[key] = float(value)
    return out
