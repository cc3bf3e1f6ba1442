"""The serving benchmark's pure parts (arrivals, lengths, percentiles, goodput, capacity) and one short
end-to-end run of the load generator against the transformers baseline server on the tiny model."""
from __future__ import annotations

import asyncio
import math
import socket
import statistics
import threading
import time

import pytest

from benchmarks.serving.client import check_loopback, run_load
from benchmarks.serving.metrics import RequestResult, meets_slo, parse_goodput, percentile, summarize
from benchmarks.serving.runner import attainment_capacity, capacity, ratio_table
from benchmarks.serving.workload import (
    BenchRequest,
    arrival_offsets,
    build_requests,
    fixed_lengths,
    make_workload,
    sharegpt_like_lengths,
)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_seeded_with_the_requested_mean_rate(burstiness: float) -> None:
    a = arrival_offsets(4000, rate=2.0, burstiness=burstiness, seed=3)
    assert a == arrival_offsets(4000, rate=2.0, burstiness=burstiness, seed=3)
    assert a != arrival_offsets(4000, rate=2.0, burstiness=burstiness, seed=4)
    gaps = [b - x for x, b in zip([0.0, *a[:-1]], a, strict=True)]
    assert all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.06)
    # gamma(k): coefficient of variation 1/sqrt(k); Poisson's is 1, burstier is larger
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_offsets(5, 0.0)


def test_length_distributions() -> None:
    pairs = sharegpt_like_lengths(2000, seed=1, max_prompt=512, max_output=128)
    assert pairs == sharegpt_like_lengths(2000, seed=1, max_prompt=512, max_output=128)
    prompts, outputs = zip(*pairs, strict=True)
    assert 16 <= min(prompts) and max(prompts) <= 512
    assert 8 <= min(outputs) and max(outputs) <= 128
    assert 30 <= statistics.median(outputs) <= 50  # log-normal, median ~40
    assert statistics.mean(outputs) > statistics.median(outputs)  # the long tail
    assert fixed_lengths(3, 200, 64) == [(200, 64)] * 3
    spread = fixed_lengths(500, 200, 64, range_ratio=0.5, seed=2)
    assert all(100 <= p <= 300 and 32 <= o <= 96 for p, o in spread)
    reqs = build_requests([(7, 3), (11, 5)], seed=0)
    assert [len(r.prompt_token_ids) for r in reqs] == [7, 11] and [r.max_tokens for r in reqs] == [3, 5]
    assert make_workload("random", 4, 0, 10, 2) == make_workload("random", 4, 0, 10, 2)


def test_percentile_matches_linear_interpolation() -> None:
    xs = [float(x) for x in range(1, 101)]
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def _result(ttft: float, itls: list[float], ok: bool = True) -> RequestResult:
    r = RequestResult(send_time=0.0, prompt_len=4, max_tokens=len(itls) + 1, ok=ok, ttft=ttft,
                      itls=itls, output_tokens=len(itls) + 1 if ok else 0)
    r.e2e = ttft + sum(itls)
    return r


def test_goodput_counts_requests_meeting_both_slos() -> None:
    results = [_result(0.1, [0.05, 0.05]),  # good
               _result(3.0, [0.05]),  # TTFT too slow
               _result(0.1, [0.05, 0.5]),  # one gap over the ITL SLO
               _result(0.1, [], ok=False)]  # failed
    slo = parse_goodput(["ttft:1000", "itl:200"])
    assert slo == {"ttft": 1000.0, "itl": 200.0}
    assert [meets_slo(r, slo["ttft"], slo["itl"]) for r in results] == [True, False, False, False]
    s = summarize(results, duration_s=2.0, offered_rate=1.0, goodput=slo)
    assert s["good_requests"] == 1 and s["goodput"] == 0.5
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["output_throughput"] == pytest.approx((3 + 2 + 3) / 2.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(50.0)
    with pytest.raises(ValueError):
        parse_goodput(["tpot:5"])


def test_capacity_needs_slo_and_keeping_up() -> None:
    def row(rate: float, p99: float, req_s: float, ttft_p99: float = 100.0) -> dict:
        return {"offered_rate": rate, "failed": 0, "itl_ms": {"p50": 1.0, "p99": p99},
                "ttft_ms": {"p99": ttft_p99}, "request_throughput": req_s, "output_throughput": 10 * req_s}

    rows = [row(0.5, 100, 0.5), row(1.0, 200, 0.95), row(2.0, 250, 1.2), row(4.0, 900, 3.9)]
    assert capacity(rows, slo_ms=300) == 1.0  # 2.0 falls behind, 4.0 breaks the SLO
    # With a TTFT SLO, keeping up is judged by TTFT (a growing queue), not by the drain-biased achieved rate.
    rows = [row(0.5, 100, 0.3), row(1.0, 200, 0.6), row(2.0, 250, 1.2, ttft_p99=9000.0)]
    assert capacity(rows, slo_ms=300, ttft_slo_ms=5000) == 1.0
    # A pass above a failing rate does not count: the short run at 2.0 had not yet shown the queue of 1.5.
    rows = [row(0.5, 100, 0.5), row(1.5, 200, 1.4, ttft_p99=6000.0), row(2.0, 250, 1.9), row(1.0, 150, 1.0)]
    assert capacity(rows, slo_ms=300, ttft_slo_ms=5000) == 1.0
    table = ratio_table({"per_target": {"a": rows, "b": rows}, "capacity": {"a": 1.0, "b": 0.5},
                         "itl_slo_ms": 300})
    assert "1.00x" in table and "capacity a/b: 2.00x" in table


def test_slo_attainment_capacity_is_the_highest_rate_where_nine_in_ten_meet_the_slo() -> None:
    def row(rate: float, good: int) -> dict:
        return {"offered_rate": rate, "num_requests": 20, "good_requests": good}

    assert attainment_capacity([row(0.5, 20), row(1.0, 18), row(2.0, 17)]) == 1.0
    assert attainment_capacity([row(0.5, 17)]) == 0.0
    assert attainment_capacity([row(2.0, 20), row(0.5, 19), row(1.0, 16)]) == 0.5
    assert attainment_capacity([{"offered_rate": 1.0, "num_requests": 20}]) is None  # no --goodput given


def test_only_loopback_targets() -> None:
    check_loopback("http://127.0.0.1:8000")
    with pytest.raises(ValueError):
        check_loopback("http://example.com")


def test_load_generator_end_to_end_against_the_hf_server(tiny_model_dir) -> None:  # noqa: ANN001
    import uvicorn

    from benchmarks.hf_server import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(str(tiny_model_dir), "tiny"), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        # the tiny model's vocab is 384 ids: prompts from its range, not the SmolLM2-sized default
        reqs = [BenchRequest([100 + 7 * i + j for j in range(12)], 6) for i in range(5)]
        results, duration = asyncio.run(run_load(f"http://127.0.0.1:{port}", "tiny", reqs,
                                                 arrival_offsets(5, 20.0), timeout_s=30, progress=False))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_tokens for r in results] == [6] * 5  # ignore_eos: lengths as drawn
    assert all(len(r.itls) == 5 and r.ttft > 0 and r.e2e >= r.ttft for r in results)
    s = summarize(results, duration, 20.0)
    assert s["completed"] == 5 and s["itl_ms"]["p99"] > 0
