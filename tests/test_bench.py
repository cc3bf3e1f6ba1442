"""The serving benchmark's workload (arrivals, lengths, prompts per point), its argument checks, its URL and API-key
handling against a stub server on loopback, `conveyor bench --help` from outside the source tree, and one short
end-to-end run of the load generator against the transformers baseline server on the tiny model."""
from __future__ import annotations

import argparse
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
from conveyor.bench.machine import cpu_model
from conveyor.bench.metrics import RequestResult, parse_goodput, summarize
from conveyor.bench.plots import MISSING_MATPLOTLIB
from conveyor.bench.workload import (
    LOGNORMAL_OUTPUT,
    LOGNORMAL_PROMPT,
    BenchRequest,
    arrival_offsets,
    build_requests,
    derive_seed,
    fixed_lengths,
    lognormal_lengths,
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


@pytest.mark.parametrize("bad", [["tpot"], ["ttfb:100"], ["ttft:fast"], ["ttft:-1"], ["ttft:nan"], ["ttft:"],
                                 ["ttft:1", "ttft:2"], []])
def test_a_bad_goodput_is_a_usage_error_before_any_request(bad: list[str], capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    with _stub_server() as (url, seen):
        with pytest.raises(SystemExit) as exit_info:
            runner.main(["--base-url", url, "--request-rate", "100", "--num-prompts", "2", "--no-plot",
                         "--no-progress", "--goodput", *bad])
        assert seen == []  # nothing was sent, not even a warm-up
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--goodput" in err and "Traceback" not in err
    with pytest.raises(ValueError):
        parse_goodput(bad or ["x"])


@pytest.mark.parametrize("bad", [["--request-rate", "1,x"], ["--request-rate", "0"], ["--request-rate", "2,,3"],
                                 ["--request-rate", "-1"], ["--num-prompts", "0"], ["--warmup-s", "-1"],
                                 ["--burstiness", "0"], ["--max-concurrency", "1.5"], ["--random-prefix-len", "-4"],
                                 ["--dataset", "lognormalx"]])
def test_bad_arguments_are_usage_errors_before_any_request(bad: list[str], capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    with _stub_server() as (url, seen):
        with pytest.raises(SystemExit) as exit_info:
            runner.main(["--base-url", url, "--num-prompts", "2", "--no-plot", "--no-progress", *bad])
        assert seen == []
    assert exit_info.value.code == 2 and bad[0] in capsys.readouterr().err
    with pytest.raises(SystemExit):
        runner.main(["compare", "--targets", "a=http://127.0.0.1:9", "--request-rates", "1,zero"])


def test_lognormal_dataset_has_the_stated_median_and_mean_and_clips() -> None:
    pairs = lognormal_lengths(5000, seed=7)
    assert pairs == lognormal_lengths(5000, seed=7) and pairs != lognormal_lengths(5000, seed=8)
    prompts, outputs = (list(x) for x in zip(*pairs, strict=True))
    assert LOGNORMAL_PROMPT.sigma == pytest.approx(0.712, abs=0.001)
    assert LOGNORMAL_OUTPUT.sigma == pytest.approx(0.834, abs=0.001)
    assert statistics.median(prompts) == pytest.approx(163, rel=0.05)
    assert statistics.mean(prompts) == pytest.approx(210, rel=0.05)  # clipping at 1240 takes ~1%
    assert statistics.median(outputs) == pytest.approx(48, rel=0.06)
    assert statistics.mean(outputs) == pytest.approx(68, rel=0.05)  # clipping at 300 takes ~2%
    assert min(prompts) >= 16 and max(prompts) == 1240  # the tail reaches the clip at this size
    assert min(outputs) >= 4 and max(outputs) == 300
    reqs = make_workload("lognormal", 50, seed=3)
    assert [(len(r.prompt_token_ids), r.max_tokens) for r in reqs] == lognormal_lengths(50, seed=3)


def _plan_args(**overrides: object) -> argparse.Namespace:
    args = runner.build_parser().parse_args(["--base-url", "http://127.0.0.1:9", "--dataset", "lognormal",
                                             "--num-prompts", "30"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def _prompts(plan: runner.PointPlan, part: slice = slice(None)) -> set[tuple[int, ...]]:
    return {tuple(r.prompt_token_ids) for r in plan.requests[part]}


def test_every_rate_point_draws_its_own_prompts() -> None:
    args = _plan_args()
    plans = [runner.plan_point(args, rate, i) for i, rate in enumerate([2.0, 3.0, 3.0])]  # a rate given twice too
    assert plans[0] == runner.plan_point(args, 2.0, 0)  # seeded: a rerun sends the same
    sets = [_prompts(p) for p in plans]
    assert all(len(x) == 30 for x in sets)
    assert not (sets[0] & sets[1]) and not (sets[1] & sets[2]) and not (sets[0] & sets[2])
    # first 16-token blocks differ too: no point is served from another's prefix cache
    assert len({p[:16] for x in sets for p in x}) == 90
    assert runner.plan_point(_plan_args(seed=1), 2.0, 0).requests != plans[0].requests  # the seed counts
    same = _plan_args(same_prompts_every_rate=True)
    assert runner.plan_point(same, 2.0, 0).requests == runner.plan_point(same, 5.0, 3).requests


def test_random_prefix_len_shares_a_prefix_across_every_point() -> None:
    args = _plan_args(random_prefix_len=32)
    plans = [runner.plan_point(args, rate, i) for i, rate in enumerate([2.0, 4.0])]
    heads = {tuple(r.prompt_token_ids[:32]) for p in plans for r in p.requests}
    assert len(heads) == 1  # one shared prefix
    tails = [{tuple(r.prompt_token_ids[32:]) for r in p.requests} for p in plans]
    assert not (tails[0] & tails[1])  # after it, the prompts are still the point's own
    lengths = [len(r.prompt_token_ids) - 32 for r in plans[0].requests]
    assert lengths == [p for p, _ in lognormal_lengths(30, derive_seed(0, 0, "measure"))]


def test_warmup_window_runs_at_the_rate_and_is_left_out() -> None:
    plan = runner.plan_point(_plan_args(warmup_s=10.0), 4.0, 0)
    warm = plan.offsets[:plan.num_warmup]
    assert 20 <= plan.num_warmup <= 60  # ~40 at 4 req/s for 10 s
    assert all(0 < t < 10.0 for t in warm) and all(t >= 10.0 for t in plan.offsets[plan.num_warmup:])
    assert plan.window_start_s == 10.0 and len(plan.requests) == plan.num_warmup + 30
    assert not (_prompts(plan, slice(None, plan.num_warmup)) & _prompts(plan, slice(plan.num_warmup, None)))
    assert runner.plan_point(_plan_args(warmup_s=10.0), math.inf, 0).num_warmup == 0  # no rate to warm up at
    # the window: measured requests only, from its opening to the last measured end
    results = [RequestResult(send_time=t, prompt_len=1, max_tokens=1, ok=True, e2e=1.0) for t in plan.offsets]
    results[0].e2e = 100.0  # a warm-up straggler does not stretch the window
    measured, duration = runner.measured_window(plan, results)
    assert len(measured) == 30 and duration == pytest.approx(plan.offsets[-1] + 1.0 - 10.0)


def test_sweep_against_a_server_sends_fresh_prompts_per_point_and_leaves_the_warmup_out(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    with _stub_server() as (url, seen):
        rc = runner.main(["--base-url", url, "--dataset", "random", "--input-len", "20", "--output-len", "3",
                          "--num-prompts", "4", "--num-warmups", "0", "--request-rate", "200,200",
                          "--warmup-s", "0.05", "--goodput", "ttft:5000", "tpot:1000", "--no-progress", "--no-plot",
                          "--out", str(out)])
        prompts = _StubServer.prompts_seen
    assert rc == 0
    saved = json.loads(out.read_text())
    points = saved["points"]
    assert [p["num_requests"] for p in points] == [4, 4]  # the warm-up window's requests are not counted
    num_warm = sum(p["num_warmup_requests"] for p in points)
    assert len(seen) == 8 + num_warm
    assert len(set(prompts)) == len(prompts)  # no prompt sent twice, across points and warm-ups
    assert all(p["attainment"] == 1.0 and p["refused"] == 0 for p in points)
    assert saved["machine"]


def test_refused_requests_are_counted_end_to_end(tmp_path: Path) -> None:
    _StubServer.refuse_every = 2  # every second request: 429
    try:
        with _stub_server() as (url, _):
            reqs = [BenchRequest([101 + i, 102], 3) for i in range(6)]
            results, duration = asyncio.run(run_load(url, "m", reqs, [0.01 * i for i in range(6)], progress=False))
    finally:
        _StubServer.refuse_every = 0
    s = summarize(results, duration, 100.0, {"ttft": 5000.0})
    assert s["refused"] == 3 and s["completed"] == 3 and s["attainment"] == pytest.approx(0.5)
    assert s["attainment_admitted"] == pytest.approx(1.0)
    assert s["refusal_ms"]["p99"] < 1000


def test_goodput_figure_is_drawn_with_its_title(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from conveyor.bench.plots import plot_goodput

    rows = [{"offered_rate": r, "attainment": a, "goodput": r * a} for r, a in [(2, 1.0), (3, 0.95), (4, 0.4)]]
    path = tmp_path / "g.png"
    title = runner.plot_title(["conveyor", "vllm"], "smollm2")
    assert "conveyor, vllm | smollm2 | " in title and cpu_model() in title
    with_intervals = [r | {"num_requests": 20, "good_requests": round(20 * r["attainment"])}
                      for r in rows]  # error bars where the counts are known; none where they are not
    plot_goodput({"conveyor": with_intervals, "vllm": rows}, path, title, {"ttft": 2000.0, "tpot": 100.0})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_model_reads_proc_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B45\nflags\t: avx512f\n")
    assert cpu_model(info).startswith("AMD EPYC 9B45, ")
    assert cpu_model(tmp_path / "missing")  # elsewhere: what platform knows


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
    prompts_seen: list[tuple[int, ...]] = []  # the token-id prompts of every request, across servers
    refuse_every = 0  # > 0: answer every n-th request with 429, as a server's admission control


class _StubCompletions(http.server.BaseHTTPRequestHandler):
    """/v1/completions streaming max_tokens one-token chunks; records each request's Authorization header."""
    server: _StubServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        _StubServer.prompts_seen.append(tuple(body["prompt"]))
        if self.server.refuse_every and len(self.server.seen) % self.server.refuse_every == 0:
            self.send_response(429)
            self.send_header("Retry-After", "1")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
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
    _StubServer.prompts_seen = []
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


def test_goodput_sweep_script_defaults_and_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import goodput

    args = goodput.parse_args(["--targets", "conveyor,static", "--static-args", "--max-num-seqs 32"])
    assert args.request_rates == [2.0, 3.0, 4.0, 5.0, 6.0] and args.dataset == "lognormal"
    assert args.warmup_s == 30.0 and parse_goodput(args.goodput) == {"ttft": 2000.0, "tpot": 100.0}
    assert goodput.server_settings(args, "static").conveyor_arg == ["--scheduling", "static", "--max-num-seqs", "32"]
    assert goodput.server_settings(args, "conveyor").conveyor_arg == []
    # the default output is git-ignored: no tracked file is written by a run
    default_out = goodput.default_out()
    assert not default_out.is_absolute()  # under the working directory, the repository root for `python -m`
    ignored = subprocess.run(["git", "check-ignore", "-q", str(default_out)], cwd=Path(__file__).parents[1])
    assert ignored.returncode == 0, default_out
    for bad in (["--targets", "conveyor,tgi"], ["--rates", "2,x"], ["--goodput", "tpot"],
                ["--targets", "vllm", "--vllm-python", str(tmp_path / "none")]):
        with pytest.raises(SystemExit) as exit_info:
            goodput.parse_args(bad)
        assert exit_info.value.code == 2
    assert "setup_vllm.sh" in capsys.readouterr().err


def test_the_simulator_replays_the_goodput_sweeps_own_requests() -> None:
    """slo_sim --goodput-points: point i is benchmarks.goodput's i-th point, warm-up first, the window after it."""
    import argparse

    from benchmarks import goodput
    from benchmarks.slo_sim import _point
    from conveyor.bench.runner import plan_point

    sim_args = argparse.Namespace(goodput_points=True, seed=0, num_prompts=12, warmup_s=5.0)
    lengths, offsets, window_start_s = _point(sim_args, 1, 2.0)
    plan = plan_point(goodput.parse_args(["--targets", "conveyor", "--num-prompts", "12", "--warmup-s", "5"]), 2.0, 1)
    assert lengths == [(len(r.prompt_token_ids), r.max_tokens) for r in plan.requests]
    assert offsets == plan.offsets and window_start_s == 5.0
    assert sum(t >= window_start_s for t in offsets) == 12
