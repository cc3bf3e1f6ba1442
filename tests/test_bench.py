"""The serving benchmark's pure parts (arrivals, lengths, percentiles, goodput, capacity), its URL and API-key
handling against a stub server on loopback, `conveyor bench --help` from outside the source tree, and one short
end-to-end run of the load generator against the transformers baseline server on the tiny model."""
from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conveyor.bench import runner
from conveyor.bench.client import run_load, validate_base_url
from conveyor.bench.metrics import RequestResult, meets_slo, parse_goodput, percentile, summarize
from conveyor.bench.plots import MISSING_MATPLOTLIB
from conveyor.bench.runner import attainment_capacity, capacity, ratio_table
from conveyor.bench.workload import (
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


def test_any_http_server_is_a_valid_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert validate_base_url("http://10.1.2.3:8000") == "http://10.1.2.3:8000"
    assert validate_base_url("https://host.example/") == "https://host.example"
    assert validate_base_url("http://[::1]:8000/prefix") == "http://[::1]:8000/prefix"
    for bad in ["ftp://host.example", "http://", "https:///v1", "host.example:8000", "http://h:port", "http://h/?a=1"]:
        with pytest.raises(ValueError, match="bad base URL"):
            validate_base_url(bad)
    with pytest.raises(ValueError, match="http or https"):
        asyncio.run(run_load("ftp://host.example", "m", [], []))
    # on the command line the same check is a usage error, not a traceback
    with pytest.raises(SystemExit) as exit_info:
        runner.main(["--base-url", "ftp://host.example"])
    assert exit_info.value.code == 2 and "the scheme must be http or https" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        runner.main(["compare", "--targets", "a=http://10.1.2.3:8000,b=gopher://x", "--request-rates", "1"])
    assert "gopher://x" in capsys.readouterr().err


class _StubServer(http.server.ThreadingHTTPServer):
    seen: list[tuple[str, str | None]]  # (path, Authorization header) of every request


class _StubCompletions(http.server.BaseHTTPRequestHandler):
    """/v1/completions streaming max_tokens one-token chunks; records each request's Authorization header."""
    server: _StubServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            self.wfile.write(f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _stub_server() -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    server = _StubServer(("127.0.0.1", 0), _StubCompletions)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_api_key_is_sent_as_a_bearer_token() -> None:
    reqs = [BenchRequest([101, 102, 103], 3)] * 2
    with _stub_server() as (url, seen):
        results, _ = asyncio.run(run_load(url + "/", "m", reqs, [0.0, 0.0], progress=False, api_key="sk-test"))
        assert all(r.ok and r.output_tokens == 3 for r in results), [r.error for r in results]
        assert seen == [("/v1/completions", "Bearer sk-test")] * 2
        seen.clear()
        asyncio.run(run_load(url, "m", reqs[:1], [0.0], progress=False))
        assert seen == [("/v1/completions", None)]  # no key, no header


def test_bench_command_takes_the_key_from_the_environment_and_saves_no_secret(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CONVEYOR_API_KEY", "sk-env")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")  # the more specific variable wins
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as without the `bench` extra: no figures, no failure
    out = tmp_path / "run.json"
    with _stub_server() as (url, seen):
        rc = runner.main(["--base-url", url, "--dataset", "random", "--num-prompts", "3", "--input-len", "4",
                          "--output-len", "2", "--num-warmups", "1", "--request-rate", "inf", "--no-progress",
                          "--out", str(out)])
    assert rc == 0
    assert seen == [("/v1/completions", "Bearer sk-env")] * 4  # the warm-up too
    saved = json.loads(out.read_text())
    assert saved["points"][0]["completed"] == 3
    assert saved["args"]["api_key"] == "<redacted>" and "sk-env" not in out.read_text()
    assert MISSING_MATPLOTLIB in capsys.readouterr().out
    assert not list(tmp_path.glob("*.png"))


def test_bench_help_runs_from_outside_the_source_tree(tmp_path: Path) -> None:
    """The installed package alone: no `benchmarks` package, no matplotlib (a dev/bench extra), not the checkout."""
    code = ("import sys; sys.modules['benchmarks'] = None; sys.modules['matplotlib'] = None; "
            "from conveyor.cli import main; sys.exit(main(['bench', '--help']))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "OpenAI-compatible" in proc.stdout and "--api-key" in proc.stdout and "--base-url" in proc.stdout


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
