"""conveyor bench's figures: percentiles, SLO attainment and goodput (conveyor/bench/metrics.py), and the capacities
and tables of a sweep (conveyor/bench/report.py), and goodput.py's table of both clients."""
from __future__ import annotations

import math

import pytest

from conveyor.bench.metrics import RequestResult, meets_slo, parse_goodput, percentile, summarize, wilson_interval
from conveyor.bench.report import attainment_capacity, capacity, goodput_table, ratio_table


def test_percentile_matches_linear_interpolation() -> None:
    xs = [float(x) for x in range(1, 101)]
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def _result(ttft: float, itls: list[float], ok: bool = True, status: int = 200) -> RequestResult:
    r = RequestResult(send_time=0.0, prompt_len=4, max_tokens=len(itls) + 1, ok=ok, ttft=ttft,
                      itls=itls, output_tokens=len(itls) + 1 if ok else 0, status=status)
    r.e2e = ttft + sum(itls)
    return r


def test_goodput_counts_requests_meeting_both_slos() -> None:
    results = [_result(0.1, [0.05, 0.05]),  # good
               _result(3.0, [0.05]),  # TTFT too slow
               _result(0.1, [0.05, 0.5]),  # one gap over the ITL SLO
               _result(0.1, [], ok=False, status=500)]  # failed
    slo = parse_goodput(["ttft:1000", "itl:200"])
    assert slo == {"ttft": 1000.0, "itl": 200.0}
    assert [meets_slo(r, slo) for r in results] == [True, False, False, False]
    s = summarize(results, duration_s=2.0, offered_rate=1.0, goodput=slo)
    assert s["good_requests"] == 1 and s["goodput"] == 0.5
    assert s["completed"] == 3 and s["failed"] == 1 and s["refused"] == 0
    assert s["output_throughput"] == pytest.approx((3 + 2 + 3) / 2.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(50.0)


def test_goodput_takes_vllm_keys_and_tpot_is_the_mean_gap_per_request() -> None:
    assert parse_goodput(["ttft:2000", "tpot:100", "e2el:30000", "itl:300"]) == {
        "ttft": 2000.0, "tpot": 100.0, "e2el": 30000.0, "itl": 300.0}
    assert parse_goodput(["tpot:0"]) == {"tpot": 0.0}  # vLLM allows 0 (non-negative)
    # TPOT = (e2e - ttft) / (output_tokens - 1), as vLLM: one slow gap among fast ones meets tpot:100, not itl:100
    bursty = _result(0.2, [0.03, 0.03, 0.03, 0.25])
    assert bursty.tpot == pytest.approx(0.085)
    assert meets_slo(bursty, {"ttft": 2000, "tpot": 100})
    assert not meets_slo(bursty, {"ttft": 2000, "itl": 100})
    assert not meets_slo(bursty, {"tpot": 80})
    assert meets_slo(bursty, {"tpot": 85}) and not meets_slo(bursty, {"e2el": 500})  # equal meets; e2e 0.54 s
    # one output token: no TPOT, which vLLM counts as 0, so it meets any tpot SLO (but still the TTFT one)
    single = _result(0.5, [])
    assert single.output_tokens == 1 and meets_slo(single, {"tpot": 0.0})
    assert not meets_slo(single, {"tpot": 0.0, "ttft": 400})
    assert summarize([single], 1.0, 1.0, {"tpot": 1.0})["good_requests"] == 1


def test_refused_requests_miss_the_slo_in_attainment_over_all_sent() -> None:
    slo = {"ttft": 2000.0, "tpot": 100.0}
    results = ([_result(0.1, [0.05] * 3) for _ in range(6)]  # good
               + [_result(2.5, [0.05] * 3)]  # admitted, TTFT missed
               + [_result(0.0, [], ok=False, status=429) for _ in range(2)]  # refused by admission control
               + [_result(0.0, [], ok=False, status=500)])  # failed otherwise: admitted, missed
    s = summarize(results, duration_s=4.0, offered_rate=2.5, goodput=slo)
    assert s["num_requests"] == 10 and s["refused"] == 2 and s["failed"] == 3
    assert s["good_requests"] == 6
    assert s["attainment"] == pytest.approx(0.6)  # 6 of the 10 sent
    assert s["attainment_admitted"] == pytest.approx(0.75)  # 6 of the 8 not refused
    assert s["goodput"] == pytest.approx(1.5)  # good requests per second of the window
    assert "attainment" not in summarize(results, 4.0, 2.5)  # no SLO, no attainment


def test_attainment_interval_is_wilsons() -> None:
    low, high = wilson_interval(72, 80)  # 90% of 80 requests
    assert (round(100 * low, 1), round(100 * high, 1)) == (81.5, 94.8)
    assert wilson_interval(80, 80)[1] == 1.0 and wilson_interval(0, 80)[0] == 0.0  # clamped, never outside [0, 1]
    assert wilson_interval(0, 80)[1] > 0.0  # 0 of 80 still leaves room above 0
    assert all(math.isnan(x) for x in wilson_interval(0, 0))
    slo = {"ttft": 2000.0}
    s = summarize([_result(0.1, [0.05]) for _ in range(3)] + [_result(3.0, [0.05])], 2.0, 2.0, slo)
    assert s["attainment_ci95"] == pytest.approx(list(wilson_interval(3, 4)))


def test_attainment_capacity_and_goodput_table() -> None:
    def row(rate: float, good: int, refused: int = 0) -> dict:
        r = summarize([], 1.0, rate, {"ttft": 2000.0})
        return r | {"num_requests": 20, "good_requests": good, "refused": refused, "attainment": good / 20,
                    "attainment_admitted": good / (20 - refused), "goodput": good / 10}

    rows = [row(2, 20), row(3, 18, refused=2), row(4, 17), row(5, 19)]
    assert attainment_capacity(rows) == 3  # 18/20 = 90% passes; 4 fails, so 5's pass does not count
    assert attainment_capacity(rows, attainment=0.95) == 2
    table = goodput_table({"a": rows, "b": [row(2, 10), row(3, 20)]})
    assert "| 3 | a | 90% (70-97) | 100% | 1.80 | 2 |" in table  # 18 of 20: a wide interval
    assert "a 3 req/s, b 0 req/s" in table


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


def test_cross_check_table_puts_both_clients_side_by_side() -> None:
    from benchmarks import goodput

    ours = summarize([_result(0.1, [0.05] * 3)] * 4, 2.0, 3.0, {"ttft": 2000.0, "tpot": 100.0})
    theirs = {"request_goodput": 1.5, "attainment": 0.75, "completed": 4, "median_ttft_ms": 120.0,
              "p99_ttft_ms": 300.0, "median_tpot_ms": 52.0, "p99_tpot_ms": 70.0, "output_throughput": 7.5,
              "goodput_slo": ["ttft:2000", "tpot:100"]}
    table = goodput.cross_check_table("conveyor", {"rate": 3.0, "ours": ours, "vllm_client": theirs})
    assert "| goodput (req/s) | 2.00 | 1.50 |" in table and "| attainment (%) | 100.00 | 75.00 |" in table
    assert "| TPOT p50 / p99 (ms) | 50 / 50 | 52 / 70 |" in table

