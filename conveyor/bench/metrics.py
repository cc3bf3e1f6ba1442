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
    status: int = 0  # the HTTP status (429: refused by admission control); 0 when none came back

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


# --goodput keys, values in ms. ttft, tpot and e2el are `vllm bench serve --goodput`'s, with its definitions; itl is
# ours: the longest gap between two chunks of the request's stream (what a reader of the stream feels; vLLM's tpot
# is that request's mean gap).
SLO_KEYS = ("ttft", "tpot", "e2el", "itl")
HTTP_TOO_MANY_REQUESTS = 429


def slo_values_ms(r: RequestResult) -> dict[str, float]:
    """The request's value of every SLO key, in ms. A request of one output token has no TPOT: vLLM counts it
    as 0 (it meets any tpot SLO), and so do we."""
    return {"ttft": 1000 * r.ttft, "tpot": 1000 * r.tpot, "e2el": 1000 * r.e2e,
            "itl": 1000 * max(r.itls, default=0.0)}


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    """Goodput counts a request only when it finished and met every SLO given (a value equal to its SLO meets
    it, as in vLLM). A refused (429) or failed request misses."""
    if not r.ok:
        return False
    values = slo_values_ms(r)
    return all(values[key] <= limit for key, limit in slo.items())


def _rate(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0


def _share(count: int, total: int) -> float:
    return count / total if total else math.nan


def wilson_interval(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a share (95% at z 1.96): how far an attainment measured on `total` requests
    may sit from the server's true one. 80 requests at 90% give 81-95%, so two runs a few points apart may not
    differ at all. (nan, nan) for no requests."""
    if total <= 0:
        return math.nan, math.nan
    share, z2 = successes / total, z * z
    center = (share + z2 / (2 * total)) / (1 + z2 / total)
    half = z / (1 + z2 / total) * math.sqrt(share * (1 - share) / total + z2 / (4 * total * total))
    return max(0.0, center - half), min(1.0, center + half)


def attainment_interval(summary: dict) -> tuple[float, float]:
    """A rate point's attainment interval from its counts (good_requests of num_requests); (nan, nan) where a
    summary lacks them (another client's figures)."""
    if "good_requests" not in summary or not summary.get("num_requests"):
        return math.nan, math.nan
    return wilson_interval(summary["good_requests"], summary["num_requests"])


def summarize(results: list[RequestResult], duration_s: float, offered_rate: float,
              goodput: dict[str, float] | None = None) -> dict:
    """One rate point. With goodput SLOs: good_requests, goodput (good req/s over duration_s), attainment (good
    over every request sent: a refused request misses) with its 95% interval (attainment_ci95, Wilson), and
    attainment_admitted (good over those not refused)."""
    done = [r for r in results if r.ok]
    refused = [r for r in results if r.status == HTTP_TOO_MANY_REQUESTS]
    itls = [g for r in done for g in r.itls]
    out_tokens = sum(r.output_tokens for r in done)
    summary = {
        "offered_rate": offered_rate, "num_requests": len(results), "completed": len(done),
        "failed": len(results) - len(done), "refused": len(refused), "duration_s": duration_s,
        "request_throughput": _rate(len(done), duration_s),
        "output_throughput": _rate(out_tokens, duration_s),
        "total_output_tokens": out_tokens,
        "ttft_ms": distribution([r.ttft for r in done]),
        "tpot_ms": distribution([r.tpot for r in done if r.output_tokens > 1]),
        "itl_ms": distribution(itls),
        "e2e_ms": distribution([r.e2e for r in done]),
        "refusal_ms": distribution([r.e2e for r in refused]),  # how fast a 429 comes back
    }
    if goodput:
        good = sum(meets_slo(r, goodput) for r in results)
        summary["goodput_slo"] = goodput
        summary["good_requests"] = good
        summary["goodput"] = _rate(good, duration_s)
        summary["attainment"] = _share(good, len(results))
        summary["attainment_ci95"] = list(attainment_interval(summary))  # what the table and the plot show
        summary["attainment_admitted"] = _share(good, len(results) - len(refused))
    return summary


def parse_goodput_spec(spec: str) -> tuple[str, float]:
    """'tpot:100' -> ('tpot', 100.0); ValueError with the reason otherwise (vLLM's rules: KEY:VALUE, a known
    key, a non-negative number of ms)."""
    key, sep, value = spec.partition(":")
    if not sep:
        raise ValueError(f"bad --goodput entry {spec!r}: expected KEY:MS, e.g. ttft:2000 tpot:100")
    if key not in SLO_KEYS:
        raise ValueError(f"bad --goodput entry {spec!r}: unknown key {key!r}; one of {', '.join(SLO_KEYS)}")
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"bad --goodput entry {spec!r}: {value!r} is not a number of ms") from None
    if not math.isfinite(ms) or ms < 0:
        raise ValueError(f"bad --goodput entry {spec!r}: the SLO must be a finite number of ms >= 0")
    return key, ms


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """['ttft:2000', 'tpot:100'] -> {'ttft': 2000.0, 'tpot': 100.0}; ValueError on a bad or repeated entry."""
    out: dict[str, float] = {}
    for spec in specs or []:
        key, ms = parse_goodput_spec(spec)
        if key in out:
            raise ValueError(f"--goodput gives {key} twice")
        out[key] = ms
    return out
