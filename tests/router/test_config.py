"""No Ray cluster needed: ServeArgs, `conveyor serve` flag/config merging, protocol -> SamplingParams."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from conveyor.cli import build_parser
from conveyor.router.app import DEFAULT_ROUTER, ServeArgs
from conveyor.router.protocol import ChatCompletionRequest, CompletionRequest
from conveyor.router.serve_cli import serve_args_from


def test_serve_args_defaults_and_validation() -> None:
    cfg = ServeArgs()
    assert cfg.model == "smollm2" and cfg.num_replicas == 1 and cfg.request_router_class == DEFAULT_ROUTER
    opts = cfg.replica_options()
    assert opts["max_ongoing_requests"] > cfg.max_waiting_requests  # the engine queue answers 429, not Serve
    assert opts["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    with pytest.raises(ValidationError, match="max_num_sqs"):
        ServeArgs(max_num_sqs=4)  # typo in a YAML file: refused, not ignored
    with pytest.raises(ValidationError, match="power of two"):
        ServeArgs(block_size=12)  # the engine's own checks run at deploy time
    with pytest.raises(ValidationError):
        ServeArgs(scheduling="fifo")
    auto = ServeArgs(autoscaling_config={"min_replicas": 1, "max_replicas": 3}).replica_options()
    assert "num_replicas" not in auto and auto["autoscaling_config"]["max_replicas"] == 3
    ours = ServeArgs(autoscaling={"max_replicas": 2}).replica_options()["autoscaling_config"]
    assert ours["max_replicas"] == 2 and "QueueAndLatencyPolicy" in ours["policy"]["policy_function"]
    with pytest.raises(ValidationError, match="not both"):
        ServeArgs(autoscaling={}, autoscaling_config={"max_replicas": 2})


def test_missing_router_falls_back_to_serve_default(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = ServeArgs(request_router_class="no.such.module:Router").router_config()
    assert "PowerOfTwoChoicesRequestRouter" in str(config.request_router_class)
    assert "cannot be imported" in caplog.text
    assert config.request_routing_stats_period_s == 0.5


def test_serve_flags_override_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    config = tmp_path / "serve.yaml"
    config.write_text("applications:\n  - name: conveyor\n    import_path: conveyor.router.app:build_app\n"
                      "    args: {model: from-file, max_num_seqs: 8, num_replicas: 3}\n")
    parser = build_parser()
    args = parser.parse_args(["serve", "--config", str(config), "--max-num-seqs", "4", "--port", "9000",
                              "--itl-slo-ms", "50"])
    merged = serve_args_from(args, args.serve_parser)
    assert merged == {"model": "from-file", "max_num_seqs": 4, "num_replicas": 3, "itl_slo_ms": 50.0}
    assert ServeArgs.model_validate(merged).engine_config().scheduler.itl_slo_ms == 50.0  # every flag maps
    monkeypatch.setenv("CONVEYOR_API_KEY", "k")
    assert serve_args_from(parser.parse_args(["serve"]), args.serve_parser) == {"api_key": "k"}


def test_kv_cache_dtype_reaches_the_engine_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import typing

    from conveyor.cli import engine_config_from_args
    from conveyor.serving.config import KV_CACHE_DTYPES

    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    assert typing.get_args(ServeArgs.model_fields["kv_cache_dtype"].annotation) == KV_CACHE_DTYPES
    assert ServeArgs().engine_config().cache.kv_cache_dtype == "auto"
    assert ServeArgs(kv_cache_dtype="bfloat16").engine_config().cache.kv_cache_dtype == "bfloat16"
    assert ServeArgs(kv_cache_dtype="fp8_e5m2").engine_config().cache.kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        ServeArgs(kv_cache_dtype="int8")
    parser = build_parser()
    args = parser.parse_args(["serve", "--kv-cache-dtype", "bfloat16", "--kv-cache-bytes", "1000000"])
    merged = serve_args_from(args, args.serve_parser)
    assert merged == {"kv_cache_dtype": "bfloat16", "kv_cache_bytes": 1000000}
    cache = ServeArgs.model_validate(merged).engine_config().cache
    assert (cache.kv_cache_dtype, cache.kv_cache_bytes) == ("bfloat16", 1000000)
    config = tmp_path / "serve.yaml"
    config.write_text("applications:\n  - name: conveyor\n    import_path: conveyor.router.app:build_app\n"
                      "    args: {kv_cache_dtype: float16}\n")
    from_file = serve_args_from(parser.parse_args(["serve", "--config", str(config)]), args.serve_parser)
    assert ServeArgs.model_validate(from_file).engine_config().cache.kv_cache_dtype == "float16"
    gen = parser.parse_args(["generate", "hi", "--kv-cache-dtype", "float32"])
    assert engine_config_from_args(gen).cache.kv_cache_dtype == "float32"
    assert engine_config_from_args(parser.parse_args(["generate", "hi"])).cache.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "int8"])


def test_async_scheduling_from_flag_and_file(tmp_path, monkeypatch) -> None:
    from conveyor.cli import engine_config_from_args

    monkeypatch.delenv("CONVEYOR_API_KEY", raising=False)
    parser = build_parser()
    args = parser.parse_args(["serve", "--async-scheduling"])
    merged = serve_args_from(args, args.serve_parser)
    assert merged == {"async_scheduling": True}
    assert ServeArgs.model_validate(merged).engine_config().scheduler.async_scheduling
    assert not ServeArgs().engine_config().scheduler.async_scheduling
    config = tmp_path / "serve.yaml"
    config.write_text("async_scheduling: true\n")
    from_file = serve_args_from(parser.parse_args(["serve", "--config", str(config)]), args.serve_parser)
    assert ServeArgs.model_validate(from_file).engine_config().scheduler.async_scheduling
    with pytest.raises(ValidationError, match="async_scheduling"):
        ServeArgs(async_scheduling=True, scheduling="static")
    generate = parser.parse_args(["generate", "hi", "--async-scheduling"])
    assert engine_config_from_args(generate).scheduler.async_scheduling


def test_protocol_to_sampling_params() -> None:
    req = CompletionRequest(prompt="hi", max_tokens=5, temperature=0.5, top_p=0.9, top_k=3, seed=10, n=2,
                            stop="x", logprobs=2)
    first, second = req.to_sampling_params(0), req.to_sampling_params(1)
    assert (first.max_tokens, first.temperature, first.top_p, first.top_k) == (5, 0.5, 0.9, 3)
    assert (first.seed, second.seed, first.stop, first.logprobs) == (10, 11, ("x",), 2)
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}],
                                 max_tokens=7, max_completion_tokens=3, logprobs=True)
    params = chat.to_sampling_params()
    assert chat.conversation() == [{"role": "user", "content": "ab"}]
    assert params.max_tokens == 3 and params.logprobs == 0  # max_completion_tokens wins; logprobs, no top
    unbounded = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).to_sampling_params()
    assert unbounded.max_tokens is None  # up to the context length, as OpenAI does


@pytest.mark.parametrize("bad", [
    {"prompt": "x", "n": 9}, {"prompt": ["x"] * 20, "n": 4}, {"prompt": "x", "echo": True},
    {"prompt": "x", "seed": -1}, {"prompt": "x", "logprobs": 21}, {"prompt": "x", "min_p": 2},
    {"prompt": [-1]}, {"prompt": "x", "stop": [""]},
])
def test_protocol_rejects(bad: dict) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(bad)


def test_make_request_carries_a_routing_prefix() -> None:
    from conveyor.router.handle_records import ROUTING_PREFIX_CHARS, make_request
    from conveyor.serving.request import SamplingParams

    params = SamplingParams()
    assert make_request("x" * 5000, params, "r1")["routing_prefix"] == "x" * ROUTING_PREFIX_CHARS
    assert make_request([1, 22, 3], params, "r2")["routing_prefix"] == "1,22,3"
    chat = make_request(None, params, "r3", messages=[{"role": "system", "content": "S"},
                                                      {"role": "user", "content": "U"}])
    assert chat["routing_prefix"].startswith("<|system|>S\n<|user|>U")
    # Same system prompt, different question: same leading characters, so affinity can hold.
    other = make_request(None, params, "r4", messages=[{"role": "system", "content": "S"},
                                                       {"role": "user", "content": "V"}])
    assert other["routing_prefix"][:12] == chat["routing_prefix"][:12]


def test_direct_ingress_settings_for_conveyor_serve() -> None:
    from conveyor.router.serve_cli import serve_env

    env = serve_env(8123, http_proxy=False)
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    # Serve allocates ingress ports from [min, max): exactly the one asked for.
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == (
        "8123", "8124")
    # Both ways, Ray's own bookkeeping reports less often (conveyor/router/serve_cli.py, ray_background_env).
    behind_proxy = serve_env(8123, http_proxy=True)
    assert not any(key.startswith(("RAY_SERVE_DIRECT_INGRESS", "RAY_SERVE_THROUGHPUT")) for key in behind_proxy)
    for settings in (env, behind_proxy):
        assert settings["RAY_event_stats"] == "0" and settings["RAY_task_events_report_interval_ms"] == "10000"
    args = build_parser().parse_args(["serve", "--http-proxy"])
    assert args.http_proxy and "http_proxy" not in serve_args_from(args, args.serve_parser)


@pytest.mark.parametrize("raise_by", [None, 3])
def test_engine_priority_setting(raise_by: int | None) -> None:
    import os
    import subprocess
    import sys

    current = os.getpriority(os.PRIO_PROCESS, 0)
    setting = "" if raise_by is None else str(current + raise_by)  # raising needs no privilege
    expected = current + (raise_by or 0)
    # In a child process: a niceness once raised cannot be lowered again without privileges.
    code = ("import os; from conveyor.serving.priority import set_engine_priority as s; "
            f"r = s({setting!r}); print(r, os.getpriority(os.PRIO_PROCESS, 0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(expected), str(expected)]
